"""`dtype: auto` (the shipped YAMLs' CPU default): bfloat16 only where the device computes it natively.

On an AVX2 CPU a bfloat16 Linear is emulated and slower than a float32 one, so the shipped `bfloat16`
decoded Qwen 1.5B at half float32's speed there and priced speculation out (docs/models.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from actors.config import ModelConfig
from actors.loading import load_lm
from deploy.config import AppConfig
from deploy.local.demo import DEFAULT_CONFIG, app_block
from speculative.engine import loading
from speculative.engine.loading import resolve_dtype
from tests.front_router import save_tiny_pair


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    return save_tiny_pair(tmp_path_factory.mktemp("dtype"))


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bfloat16_only_where_native(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    monkeypatch.setattr(loading, "native_bf16", lambda device: native or device.startswith("cuda"))
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if native else "float32")
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    assert resolve_dtype("float32", "cuda") == "float32" and resolve_dtype("bfloat16", "cpu") == "bfloat16"
    with pytest.raises(ValueError, match="dtype: expected 'auto' or one of"):
        resolve_dtype("fp8")


def _cpu_flags() -> set[str] | None:
    """This CPU's feature flags as the kernel lists them (None where /proc/cpuinfo has none: not Linux x86)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    lines = [line for line in text.splitlines() if line.startswith("flags")]
    return set(lines[0].split(":", 1)[1].split()) if lines else None


def test_this_cpu_reads_its_own_bf16_support() -> None:
    """Checked against the kernel's own CPU flags, not against the call it makes: bf16 instructions
    (AVX-512 BF16 or AMX) mean native; no AVX-512 at all (an AVX2 machine) means emulated. oneDNN also
    counts plain AVX-512 (BW, VL, DQ) as bf16-capable, so that middle case is not asserted either way."""
    flags = _cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo flags on this machine")
    if flags & {"avx512_bf16", "amx_bf16"}:
        assert loading.native_bf16("cpu")
    elif "avx512f" not in flags:
        assert not loading.native_bf16("cpu")
    else:
        pytest.skip("AVX-512 without bf16 instructions: oneDNN's own call decides")


def test_the_shipped_default_loads_what_this_machine_computes_natively(folders: tuple[Path, Path, Any]) -> None:
    args = app_block(DEFAULT_CONFIG)[1]
    app = AppConfig.model_validate(args)
    assert app.dtype == "auto" and AppConfig.model_fields["dtype"].default == "auto"
    target = app.target().model
    model = load_lm(target.model_copy(update={"path": str(folders[0])}))
    want = torch.bfloat16 if loading.native_bf16("cpu") else torch.float32
    assert {p.dtype for p in model.parameters()} == {want}
    explicit = load_lm(ModelConfig(path=str(folders[0]), dtype="bfloat16"))
    assert {p.dtype for p in explicit.parameters()} == {torch.bfloat16}
