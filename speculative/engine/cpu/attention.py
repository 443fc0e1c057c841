"""Batch-invariant attention as one C call per layer (`kernels/attention.c` on CPUs with AVX-512, else its AVX2
twin `kernels/attention_avx2.c`): each query row's sums fixed by the row alone, in float32, so
`invariant.invariant_attention` computes the same attention (to rounding: its own exp and sum order) with the
same invariance, at a fraction of the torch formulation's per-op cost (a decode step's 28 layers: one call each
instead of ~20 torch ops each). The same builds rotate the queries and keys before it (`rotate`: one call a
tensor instead of seven ops, torch's bits). Built at install (`compiled`); where it cannot run, `attend` returns
None, `rotate` False, and the torch formulation runs."""

from __future__ import annotations

import ctypes
import functools

import torch

from speculative.engine.cpu import compiled


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel as the install built it, AVX-512's where this CPU has it, else AVX2's; None where this machine
    runs neither or it was not built."""
    pointer, long, count = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    arguments = [pointer, long, long, long, pointer, pointer, long, long, long, pointer, long, long]
    arguments += [count] * 7 + [pointer]
    for name in ("attention", "attention_avx2"):
        if compiled.cpu_supports(compiled.BUILDS[name].cpu):
            rotate = ([pointer, count, count, count, pointer, pointer], None)
            functions = {"attend": (arguments, count), "rotate_halves": rotate}
            return compiled.library(name, "invariant attention", functions)
    return None


def rotate(
    x: torch.Tensor,  # [T, heads * D] float32, contiguous
    cos: torch.Tensor,  # [T, D] float32, contiguous
    sin: torch.Tensor,  # [T, D] float32, contiguous
    dim: int,  # D
) -> bool:
    """Rotates x's heads in place as `apply_rotary_pos_emb` rotates halves (torch's bits: one C call instead of seven
    ops a tensor); False, x untouched, where the kernel does not take these tensors."""
    lib = library()
    tensors = (x, cos, sin)
    if lib is None or any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return False
    if dim % 2 or x.shape[-1] % dim or cos.shape != (x.shape[0], dim) or sin.shape != cos.shape:
        return False
    lib.rotate_halves(x.data_ptr(), x.shape[0], x.shape[-1] // dim, dim, cos.data_ptr(), sin.data_ptr())
    return True


def attend(
    query: torch.Tensor,  # [b, heads, m, D]
    key: torch.Tensor,  # [b, kv_heads, C, D]
    value: torch.Tensor,  # [b, kv_heads, C, D]
    mask: torch.Tensor,  # [b, 1, g * m, C] additive
    scaling: float,
) -> torch.Tensor | None:  # [b, m, heads, D] in the query's dtype; None where the kernel does not take these
    lib = library()
    if lib is None or query.device.type != "cpu" or key.dtype not in (torch.float32, torch.bfloat16):
        return None
    b, heads, m, dim = query.shape
    kv_heads, columns = key.shape[1], key.shape[2]
    if dim % 8 or dim > 256 or value.dtype != key.dtype:  # (the AVX-512 kernel refuses widths not of 16 below)
        return None
    q = (query.float() * scaling).contiguous()  # [b, heads, m, D]
    k, v = key, value  # [b, kv_heads, C, D] each, one set of strides for both, the head width contiguous
    if k.stride(-1) != 1 or v.stride() != k.stride():
        k, v = k.contiguous(), v.contiguous()
    bias = mask.float().reshape(b, -1, columns).contiguous()  # [b, g * m, C]
    out = torch.empty(b, m, heads, dim)  # [b, m, heads, D] float32
    failed = lib.attend(
        q.data_ptr(), q.stride(0), q.stride(1), q.stride(2),
        k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
        bias.data_ptr(), bias.stride(0), bias.stride(1),
        b, heads, kv_heads, m, columns, dim, int(k.dtype == torch.bfloat16), out.data_ptr(),
    )  # fmt: skip
    return None if failed else out.to(query.dtype)
