"""The AVX-512 VNNI kernel for 4-bit draft weights (`kernels/int4_vnni.c`): its build, its layout, its call.

torch's weight-only int4 kernel dequantizes every weight to bfloat16 before it multiplies, so on one core a
decode-sized call reads its weights at about two thirds of the rate the core can stream them. This kernel
quantizes the few activation rows to int8 instead and multiplies the 4-bit weights as bytes (VPDPBUSD), so a
call streams its weights once at about the memory's rate (`bench/results/draft_quantize.md`). It is a draft's
kernel: int8 activations change a draft's logits by about 1 %, which changes how many drafts are accepted,
never the output.

The C source is built when the package is installed (`compiled`); a kernel not built (no compiler) or a CPU
without AVX-512 VNNI and BF16 leaves `library()` None, and `Int4Linear` then uses torch's.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from speculative.engine.cpu import compiled

TILE, GROUP, MAX_ROWS = 16, 32, 8  # as in the C source


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel as the install built it; None where this machine cannot run it or it was not built."""
    pointer, count = ctypes.c_void_p, ctypes.c_int
    mm = ([pointer, count, count, pointer, count, pointer], ctypes.c_int)  # W, out, in, x, rows, y
    return compiled.library("int4_vnni", "int4 draft weights", {"int4_vnni_mm": mm})


def pack(levels: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of weights `scale * levels + low` per group: levels [out, in] (0..15), scale and
    low [out, in / GROUP] -> [tiles, in / GROUP, 320] uint8 (outputs padded to whole tiles of 16)."""
    out, inp = levels.shape
    groups, tiles = inp // GROUP, -(-out // TILE)
    pad = tiles * TILE - out
    levels = torch.nn.functional.pad(levels.to(torch.uint8), (0, 0, 0, pad))  # [tiles * 16, in]
    scale, low = (torch.nn.functional.pad(t.float(), (0, 0, 0, pad)) for t in (scale, low))  # [tiles * 16, G]
    split = levels.reshape(tiles, TILE, groups, 4, 2, 4)  # [tile, lane, group, chunk, low/high nibble, byte]
    nibbles = (split[:, :, :, :, 0] | (split[:, :, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)  # [T, G, chunk, lane, b]

    def per_tile(t: torch.Tensor) -> torch.Tensor:  # [tiles * 16, G] -> [T, G, 32] bytes of bfloat16
        return t.reshape(tiles, TILE, groups).transpose(1, 2).to(torch.bfloat16).contiguous().view(torch.uint8)

    return torch.cat([nibbles.reshape(tiles, groups, 256), per_tile(scale), per_tile(low)], dim=-1).contiguous()


def matmul(packed: torch.Tensor, out: int, rows: torch.Tensor) -> torch.Tensor:
    """rows [M, in] bfloat16 (1 <= M <= MAX_ROWS) -> [M, out] bfloat16 through weights `pack` laid out."""
    lib, rows = compiled.rows_for(library(), "int4 VNNI", rows, torch.bfloat16)
    y = torch.empty(rows.shape[0], out, dtype=torch.bfloat16)  # [M, out]
    if lib.int4_vnni_mm(packed.data_ptr(), out, rows.shape[1], rows.data_ptr(), rows.shape[0], y.data_ptr()):
        raise RuntimeError(f"int4 kernel refused {rows.shape[0]} rows of {rows.shape[1]} inputs")
    return y
