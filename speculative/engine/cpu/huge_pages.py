"""Weights a kernel streams from memory every step, gathered onto 2 MiB pages.

A decode step reads every weight once, from DRAM, in one sequential stream per thread. On 4 KiB pages that
stream crosses a page every 4 KiB: each crossing is a TLB miss, and the hardware prefetcher stops at it (it
never fetches across a page), so a core waits on memory it could have had in flight. On 2 MiB pages the
same stream crosses a page every 2 MiB. The GGUF kernel's one-row call reads its tiles ~1.2x faster there
on an AVX2 AMD EPYC (`docs/models.md`); calls of many rows, bound by arithmetic, gain less.

Linux backs an anonymous mapping with transparent huge pages where the mapping is advised MADV_HUGEPAGE (THP
`madvise`, most distributions' default) or always (THP `always`). Where THP is off, or on another OS, the arena
is ordinary memory: the same bytes, the same results, only the pages differ. The kernels read the same
values from either memory, so no output changes.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterable

import torch

PAGE = 2 << 20  # a huge page's bytes (x86-64)
ALIGN = 64  # each tensor starts on a cache line


def arena(nbytes: int) -> torch.Tensor:  # [nbytes] uint8, starting on a PAGE boundary
    """Zeroed memory for `nbytes`, from an anonymous mapping advised to take huge pages (where the OS does). Its
    pages come as it is first written; the tensor holds the mapping."""
    region = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # PAGE more: room to align
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):  # a kernel built without THP: ordinary pages
            region.madvise(advice)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds `region` for as long as a view of it lives
    start = -whole.data_ptr() % PAGE
    return whole[start : start + nbytes]


def carve(sizes: list[int]) -> list[torch.Tensor]:
    """Views of one `arena` side by side, view i [sizes[i]] uint8, each starting on a cache line (ALIGN)."""
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + -(-size // ALIGN) * ALIGN)
    memory = arena(max(starts[-1], 1))
    return [memory[start : start + size] for start, size in zip(starts, sizes, strict=False)]


def gather(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU `tensors` (each contiguous, any dtype and shape) side by side in one `arena`."""
    tensors = list(tensors)
    places = carve([t.numel() * t.element_size() for t in tensors])
    copies = []
    for t, place in zip(tensors, places, strict=True):
        copy = place.view(t.dtype).view(t.shape)
        copy.copy_(t)
        copies.append(copy)
    return copies


def onto_huge_pages(model: torch.nn.Module) -> int:
    """Moves the packed weights of `model`'s GGUF-kernel layers (`kquant.KQuantLinear`) into one arena, in
    place, before any forward (a layer's kernel call is made from its weights on first use); returns the bytes
    moved."""
    from speculative.engine.cpu.kquant import KQuantLinear

    layers = [m for m in model.modules() if isinstance(m, KQuantLinear)]
    for layer, packed in zip(layers, gather(m.packed for m in layers), strict=True):
        layer.packed = packed
        layer.__dict__.pop("_alone", None)  # a kernel call made from the old buffer, if any
    return sum(m.packed.numel() for m in layers)
