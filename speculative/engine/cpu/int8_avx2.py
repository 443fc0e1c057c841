"""The AVX2 kernel for a few rows against int8 draft weights (`kernels/int8_avx2.c`): its layout and its call.

A draft step multiplies one to a few float32 rows by every weight once. torch's int8 kernels without the
deprecated quantized dtypes either widen each weight once per row (`aten._weight_int8pack_mm`, bfloat16 rows) or
quantize the rows per call (oneDNN's int8 matmul); this kernel widens each weight once per call and multiplies
the float32 rows directly, 8 outputs per register (`bench/results/draft_quantize.md`).

The C source is built when the package is installed (`compiled`); a kernel not built (no compiler) or a CPU
without AVX2 and FMA leaves `library()` None, and `Int8Linear` then uses torch's kernels.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from speculative.engine.cpu import compiled

TILE, MAX_ROWS = 8, 8  # as in the C source


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel as the install built it; None where this machine cannot run it or it was not built."""
    pointer, count = ctypes.c_void_p, ctypes.c_int
    mm = ([pointer, count, count, pointer, count, pointer, pointer, pointer], ctypes.c_int)  # W, O, I, x, M, s, b, y
    return compiled.library("int8_avx2", "int8 draft weights", {"int8_avx2_mm": mm})


def tiles(out: int) -> int:
    return -(-out // TILE)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """codes [out, in] int8 -> the kernel's [tiles, in, 8] (outputs padded with zero weights to whole tiles)."""
    out, inp = codes.shape
    padded = torch.nn.functional.pad(codes, (0, 0, 0, tiles(out) * TILE - out))  # [tiles * 8, in]
    return padded.reshape(-1, TILE, inp).transpose(1, 2).contiguous()


def padded(values: torch.Tensor) -> torch.Tensor:
    """A per-output vector [out] -> float32 [tiles * 8], as the kernel reads scales and biases."""
    return torch.nn.functional.pad(values.float(), (0, tiles(values.shape[0]) * TILE - values.shape[0])).contiguous()


def matmul(packed: torch.Tensor, out: int, rows: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """rows [M, in] float32 (1 <= M <= MAX_ROWS) -> [M, out] float32: rows W^T * scale + bias, W as `pack` lays it
    out, scale and bias as `padded`."""
    lib, rows = compiled.rows_for(library(), "int8 AVX2", rows, torch.float32)
    y = torch.empty(rows.shape[0], out, dtype=torch.float32)  # [M, out]
    args = (packed.data_ptr(), out, rows.shape[1], rows.data_ptr(), rows.shape[0], scale.data_ptr(), bias.data_ptr())
    if lib.int8_avx2_mm(*args, y.data_ptr()):
        raise RuntimeError(f"int8 kernel refused {rows.shape[0]} rows of {rows.shape[1]} inputs")
    return y
