"""Weights a kernel streams every step sit in one arena on 2 MiB pages (`speculative/engine/cpu/huge_pages.py`):
copies with the same values, each on a cache line, the arena on a huge page's boundary, and backed by huge pages
where this machine's transparent huge pages take advice."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actors.config import ModelConfig
from actors.loading import load_lm
from speculative.engine.cpu import huge_pages, kquant
from tests.unit.test_kquant import _tiny

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _advised() -> bool:
    """Whether anonymous memory advised MADV_HUGEPAGE gets huge pages here (THP `always` or `madvise`)."""
    return THP.exists() and ("[always]" in THP.read_text() or "[madvise]" in THP.read_text())


def _huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_gathered_tensors_keep_their_values_on_aligned_memory() -> None:
    tensors = [torch.arange(10, dtype=torch.uint8), torch.randn(3, 5), torch.arange(7, dtype=torch.int32).view(7, 1)]
    copies = huge_pages.gather(tensors)
    for t, c in zip(tensors, copies, strict=True):
        assert torch.equal(t, c) and c.dtype == t.dtype and c.is_contiguous()
        assert c.data_ptr() % huge_pages.ALIGN == 0
    assert copies[0].data_ptr() % huge_pages.PAGE == 0
    copies[1].zero_()  # copies, not views of the originals
    assert tensors[1].abs().sum() > 0


@pytest.mark.skipif(not _advised(), reason="transparent huge pages are off on this machine")
def test_an_arena_is_backed_by_huge_pages() -> None:
    memory = huge_pages.arena(8 * huge_pages.PAGE)
    memory.fill_(1)  # pages come as they are first written
    assert _huge_kib(memory.data_ptr()) >= 2048


@pytest.mark.skipif(kquant.library() is None, reason="no AVX2 CPU or no kernel build here")
def test_a_stored_models_gguf_layers_share_one_arena(tmp_path: Path) -> None:
    """Loading a GGUF target moves every layer's packed tiles into one arena (the first on a huge page's boundary,
    one after another)."""
    folder, _ = _tiny(tmp_path)
    model = load_lm(ModelConfig(path=str(folder), dtype="float32", weights="stored"))
    layers = [m for m in model.modules() if isinstance(m, kquant.KQuantLinear)]
    starts = [m.packed.data_ptr() for m in layers]
    assert layers and starts[0] % huge_pages.PAGE == 0
    ends = [s + m.packed.numel() for s, m in zip(starts, layers, strict=True)]
    assert all(0 <= nxt - end < huge_pages.ALIGN for end, nxt in zip(ends, starts[1:], strict=False))
