"""GGUF-quantized Linear weights at their stored precision (Q4_K, Q6_K, Q8_0) and their kernels: `kquant_vnni.c`
on CPUs with AVX-512 VNNI, else `kquant_avx2.c` (one layout, one interface, the same integer sums and float steps).

A GGUF tensor's blocks are laid out for the kernel once at load, in C from the file's bytes (`pack_stored`; the
layout is defined by `pack` of the codes and scales `decode` reads, which a draft's Q4_1 weights take), and
multiplied by `matmul`: activations quantized to int8 per 32 inputs, weights read as stored.
`dequantize` gives the weights the same codes and scales stand for, in float32 (the reference the kernel is
held to: int8 activations put its outputs within about 1 % of the row's scale of the float32 product).

Each row is reduced alone in a fixed order, so a row's outputs are the same bits at 1 row or 64, on any
number of threads: a target on these weights is batch invariant by construction.

The AVX2 kernel also takes Q4_1 (32-input groups of 4-bit levels with a float16 scale and minimum): a draft
model's weights on CPUs without native bfloat16, quantized at load (`from_grid`, `int4_linear`).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from speculative.engine.cpu import compiled

TILE = 16  # outputs per tile, as in the C sources
KERNELS = ("kquant_vnni", "kquant_avx2")  # builds of compiled.BUILDS, the first this CPU runs taken
Q4_K, Q6_K, Q8_0, Q4_1 = 12, 14, 8, 3  # GGML's type ids
NAMES = {Q4_K: "Q4_K", Q6_K: "Q6_K", Q8_0: "Q8_0", Q4_1: "Q4_1"}
BLOCK_BYTES = {Q4_K: 144, Q6_K: 210, Q8_0: 34, Q4_1: 20}  # a GGUF block's bytes
BLOCK_INPUTS = {Q4_K: 256, Q6_K: 256, Q8_0: 32, Q4_1: 32}
TARGET_KINDS = (Q4_K, Q6_K, Q8_0)  # what a GGUF target file's Linear layers are (Q4_1: the AVX2 kernel alone)


@functools.cache
def libraries() -> tuple[ctypes.CDLL, ...]:
    """The kernels as the install built them that this CPU runs, in KERNELS' order (fastest first)."""
    pointer, count = ctypes.c_void_p, ctypes.c_int
    many = (
        [count, pointer, pointer, pointer, count, pointer, count, pointer, count, count, pointer, ctypes.c_float],
        ctypes.c_int,
    )
    functions: dict[str, compiled.Signature] = {
        "kquant_mm_many": many,
        "kquant_place": ([pointer, count], ctypes.c_int),
        "kquant_tile_bytes": ([count, count], ctypes.c_long),
        "kquant_pack": ([count, pointer, ctypes.c_long, count, count, pointer, pointer], ctypes.c_int),
    }
    found = [
        compiled.library(n, "GGUF weights", functions) for n in KERNELS if compiled.cpu_supports(compiled.BUILDS[n].cpu)
    ]
    return tuple(lib for lib in found if lib is not None)


@functools.cache
def library(kinds: tuple[int, ...] = TARGET_KINDS) -> ctypes.CDLL | None:
    """The first kernel this machine runs that takes every format of `kinds` (AVX-512 VNNI's where this CPU has
    it, else AVX2's); None where none does (another CPU, or no build). Cached: every kernel call asks it."""
    for lib in libraries():
        if all(lib.kquant_tile_bytes(kind, 256) > 0 for kind in kinds):
            return lib
    return None


_threads: int | None = None  # the kernel's threads while `borrowing`; None: torch's thread count


@contextmanager
def borrowing(cores: tuple[int, ...]) -> Iterator[bool]:
    """Inside the block the kernel runs on len(cores) threads, thread i >= 1 pinned to cores[i] (the caller,
    thread 0, stays on its own cores): a target lends itself the draft's idle core for a forward. Yields whether
    the threads were placed (False: another OS, or a core refused; the kernel keeps torch's thread count)."""
    global _threads
    lib = library()
    array = (ctypes.c_int * len(cores))(*cores)
    placed = lib is not None and len(cores) > 1 and lib.kquant_place(ctypes.addressof(array), len(cores)) == 0
    before, _threads = _threads, len(cores) if placed else _threads
    try:
        yield placed
    finally:
        _threads = before


def takes(kind: int, inputs: int) -> bool:
    """Whether a kernel here takes weights of GGML type `kind` with `inputs` inputs per output."""
    return kind in BLOCK_INPUTS and inputs % BLOCK_INPUTS[kind] == 0 and library((kind,)) is not None


@dataclass(frozen=True)
class Codes:
    """A tensor's GGUF blocks decoded: its unsigned codes and the scales that make them weights."""

    kind: int  # GGML type id
    codes: torch.Tensor  # [out, in] uint8: Q4_K and Q4_1 0..15, Q6_K 0..63, Q8_0 q + 128
    d: torch.Tensor  # [out, in / 256] (Q8_0, Q4_1: [out, in / 32]) float16
    dmin: torch.Tensor | None  # Q4_K: [out, in / 256] float16; Q4_1: [out, in / 32] float16, the minimum m
    scales: torch.Tensor | None  # Q4_K: [out, in / 32] uint8; Q6_K: [out, in / 16] int8
    mins: torch.Tensor | None  # Q4_K: [out, in / 32] uint8


def decode(kind: int, raw: np.ndarray, inputs: int) -> Codes:
    """A GGUF tensor's bytes ([out, blocks * block bytes] uint8, as gguf's reader gives them) -> its Codes."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"GGUF type {kind} has no kernel here (Q4_K, Q6_K and Q8_0 have)")
    out = raw.shape[0]
    blocks = torch.from_numpy(np.array(raw, copy=True)).reshape(out, inputs // BLOCK_INPUTS[kind], BLOCK_BYTES[kind])

    def half(at: int) -> torch.Tensor:  # [out, blocks] float16 at byte `at` of each block
        return blocks[..., at : at + 2].contiguous().view(torch.float16).squeeze(-1)

    if kind == Q4_1:  # 16 bytes: inputs 0..15 in the low nibbles, 16..31 in the high
        qs = blocks[..., 4:20]  # [out, blocks, 16]
        codes = torch.cat([qs & 15, qs >> 4], dim=-1)  # [out, blocks, 32]
        return Codes(kind, codes.reshape(out, inputs), half(0), half(2), None, None)
    if kind == Q8_0:
        q = blocks[..., 2:34].contiguous().view(torch.int8).to(torch.int16) + 128  # [out, blocks, 32]
        return Codes(kind, q.to(torch.uint8).reshape(out, inputs), half(0), None, None, None)
    if kind == Q4_K:
        packed = blocks[..., 4:16].to(torch.int32)  # [out, blocks, 12]: 8 six-bit scales and 8 six-bit mins
        low4, high4 = packed[..., 0:4], packed[..., 4:8]
        scales = torch.cat([low4 & 63, (packed[..., 8:12] & 15) | ((low4 >> 6) << 4)], dim=-1)  # [out, blocks, 8]
        mins = torch.cat([high4 & 63, (packed[..., 8:12] >> 4) | ((high4 >> 6) << 4)], dim=-1)
        qs = blocks[..., 16:144].reshape(out, -1, 4, 32)  # [out, blocks, 64-value chunk, 32]
        codes = torch.stack([qs & 15, qs >> 4], dim=3)  # [out, blocks, chunk, low/high: +0/+32, 32]
        return Codes(
            kind,
            codes.reshape(out, inputs),
            half(0),
            half(2),
            scales.to(torch.uint8).reshape(out, -1),
            mins.to(torch.uint8).reshape(out, -1),
        )
    ql = blocks[..., 0:128].reshape(out, -1, 2, 2, 32)  # [out, blocks, half, l / l + 32, 32]
    qh = blocks[..., 128:192].reshape(out, -1, 2, 1, 32)  # [out, blocks, half, 1, 32]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)  # the 2 bits of l, l+32, l+64, l+96
    low = torch.cat([ql & 15, ql >> 4], dim=3)  # [out, blocks, half, 4, 32]: values l, l+32, l+64, l+96
    codes = low | (((qh >> shifts) & 3) << 4)
    scales = blocks[..., 192:208].contiguous().view(torch.int8)  # [out, blocks, 16]
    return Codes(kind, codes.reshape(out, inputs), half(208), None, scales.reshape(out, -1), None)


def dequantize(c: Codes) -> torch.Tensor:
    """The float32 weights [out, in] that `c` stands for, computed as GGUF's reference does."""
    out, inputs = c.codes.shape
    u = c.codes.to(torch.float32)
    if c.kind == Q8_0:
        return (c.d.float().repeat_interleave(32, dim=1) * (u - 128)).reshape(out, inputs)
    if c.kind == Q4_1:
        assert c.dmin is not None
        return c.d.float().repeat_interleave(32, dim=1) * u + c.dmin.float().repeat_interleave(32, dim=1)
    if c.kind == Q4_K:
        assert c.dmin is not None and c.scales is not None and c.mins is not None
        scale = (c.d.float().repeat_interleave(8, dim=1) * c.scales.float()).repeat_interleave(32, dim=1)
        low = (c.dmin.float().repeat_interleave(8, dim=1) * c.mins.float()).repeat_interleave(32, dim=1)
        return scale * u - low
    assert c.scales is not None
    scale = (c.d.float().repeat_interleave(16, dim=1) * c.scales.float()).repeat_interleave(16, dim=1)
    return scale * (u - 32)


def packed_bytes(kind: int, out: int, inputs: int) -> int:
    """Bytes of the kernel's layout of `out` outputs of `inputs` inputs in format `kind` (whole tiles of 16), as
    the kernel here that takes `kind` counts them; 0 where none does."""
    lib = library((kind,))
    return -(-out // TILE) * int(lib.kquant_tile_bytes(kind, inputs)) if lib is not None else 0


def pack_stored(kind: int, raw: np.ndarray, inputs: int, order: torch.Tensor | None, into: torch.Tensor) -> None:
    """A GGUF tensor's bytes ([rows, blocks * block bytes] uint8, as the file stores them) in the kernel's layout,
    written into `into` ([packed_bytes] uint8, zeroed), in C: `pack(decode(...))`'s bytes, ~30x sooner. Output o
    is the file's row order[o] (None: row o)."""
    out = raw.shape[0] if order is None else len(order)
    need = packed_bytes(kind, out, inputs)
    if not need:
        raise ValueError(f"no kernel here takes {NAMES.get(kind, kind)} weights of {inputs} inputs")
    if into.numel() != need or into.dtype != torch.uint8 or not into.is_contiguous():
        raise ValueError(f"{NAMES[kind]} [{out}, {inputs}] takes {need} contiguous bytes")
    raw = np.ascontiguousarray(raw)
    rows = None if order is None else order.to(torch.int64).contiguous()
    pointer = None if rows is None else rows.data_ptr()
    lib = library((kind,))
    assert lib is not None  # (packed_bytes found it)
    if lib.kquant_pack(kind, raw.ctypes.data, raw.shape[1], out, inputs, pointer, into.data_ptr()):
        raise ValueError(f"no kernel here lays out {NAMES[kind]} weights of {inputs} inputs")


def pack(c: Codes) -> torch.Tensor:
    """The kernel's layout of `c` (the C source's header says it): [tiles, tile bytes] uint8, outputs padded to
    whole tiles of 16 with zero scales. The definition `pack_stored` is held to, and the layout of a draft's Q4_1
    codes."""
    out = c.codes.shape[0]
    tiles = -(-out // TILE)

    def padded(t: torch.Tensor) -> torch.Tensor:  # [out, n] -> [tiles, 16, n]
        return torch.nn.functional.pad(t, (0, 0, 0, tiles * TILE - out)).reshape(tiles, TILE, -1)

    def per_tile(t: torch.Tensor, per: int) -> torch.Tensor:  # [out, n] -> [tiles, n / per, per * 16 values' bytes]
        lanes = padded(t).transpose(1, 2).contiguous()  # [tiles, n, 16]: a value per output of the tile
        return lanes.view(torch.uint8).reshape(tiles, lanes.shape[1] // per, -1)

    codes = padded(c.codes)  # [tiles, 16, in]
    if c.kind == Q8_0:
        blocks = codes.reshape(tiles, TILE, -1, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, -1, 512)  # [T, G, 512]
        return torch.cat([per_tile(c.d, 1), blocks], dim=-1).reshape(tiles, -1).contiguous()
    low = codes & 15
    if c.kind == Q4_1:  # per 32 inputs: d[16], m[16], then the 4 chunks of nibbles of a Q4_K group
        assert c.dmin is not None
        split = low.reshape(tiles, TILE, -1, 4, 2, 4)  # [tile, lane, group, chunk, low/high nibble, byte]
        nibbles = (split[..., 0, :] | (split[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)  # [T, G, chunk, lane, b]
        parts = [per_tile(c.d, 1), per_tile(c.dmin, 1), nibbles.reshape(tiles, -1, 256)]  # [T, G, 32/32/256]
        return torch.cat(parts, dim=-1).reshape(tiles, -1).contiguous()
    split = low.reshape(tiles, TILE, -1, 8, 4, 2, 4)  # [tile, lane, 256s, group, chunk, low/high nibble, byte]
    nibbles = (split[..., 0, :] | (split[..., 1, :] << 4)).permute(0, 2, 3, 4, 1, 5)  # [T, S, group, chunk, lane, b]
    nibbles = nibbles.reshape(tiles, -1, 8, 256)  # [T, S, group, 256]
    d = per_tile(c.d, 1)  # [T, S, 32]
    assert c.scales is not None
    if c.kind == Q4_K:
        assert c.dmin is not None and c.mins is not None
        header = [d, per_tile(c.dmin, 1), per_tile(c.scales, 8), per_tile(c.mins, 8)]
        return torch.cat([*header, nibbles.reshape(tiles, -1, 2048)], dim=-1).reshape(tiles, -1).contiguous()
    high = (codes >> 4).reshape(tiles, TILE, -1, 8, 2, 4, 4)  # [tile, lane, 256s, group, half, quarter, byte]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)
    bits = (high << shifts).sum(dim=5, dtype=torch.uint8).permute(0, 2, 3, 4, 1, 5)  # [T, S, group, half, lane, b]
    groups = torch.cat([nibbles, bits.reshape(tiles, -1, 8, 128)], dim=-1).reshape(tiles, -1, 8 * 384)
    return torch.cat([d, per_tile(c.scales, 16), groups], dim=-1).reshape(tiles, -1).contiguous()


def from_grid(levels: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> Codes:
    """4-bit weight groups (levels [out, in] 0..15; scale and low [out, in / 32]: w = levels * scale + low, as
    `int4_linear` quantizes a draft) as Q4_1 codes, their scale and minimum in float16 as GGML stores them."""
    return Codes(Q4_1, levels.to(torch.uint8), scale.to(torch.float16), low.to(torch.float16), None, None)


def _checked(rows: torch.Tensor, kinds: tuple[int, ...]) -> ctypes.CDLL:
    lib = library(kinds)
    if lib is None:
        names = ", ".join(NAMES[k] for k in kinds)
        raise RuntimeError(
            f"no GGUF weights' kernel for {names} runs on this machine (AVX2 or AVX-512 VNNI, a C compiler)"
        )
    if rows.dtype not in (torch.float32, torch.bfloat16) or rows.device.type != "cpu":
        raise ValueError(
            f"the GGUF kernel takes float32 or bfloat16 rows on the CPU, not {rows.dtype} on {rows.device}"
        )
    return lib


class Weights:
    """Packed weights of one input width that one kernel call multiplies together (a layer's q, k and v): the
    input is quantized once, and the threads split the tiles of all of them."""

    def __init__(self, kinds: list[int], packed: list[torch.Tensor], outs: list[int]) -> None:
        if not 1 <= len(kinds) <= 8:
            raise ValueError(f"one kernel call takes 1 to 8 weights, not {len(kinds)}")
        self.packed = packed  # held: the pointers below point into them
        self.outs = outs
        self.kinds = tuple(kinds)
        self._kinds = (ctypes.c_int * len(kinds))(*kinds)
        self._pointers = (ctypes.c_void_p * len(kinds))(*(p.data_ptr() for p in packed))
        self._outs = (ctypes.c_int * len(kinds))(*outs)

    def __call__(self, rows: torch.Tensor, threads: int = 1, norm: Norm | None = None) -> list[torch.Tensor]:
        """rows [M, in] float32 or bfloat16 -> per weight [M, out] in their dtype; with `norm`, of the rows
        RMS-normalized by it (in float32, as the kernel reads them)."""
        lib = _checked(rows, self.kinds)
        rows = rows.contiguous()
        ys = [torch.empty(rows.shape[0], o, dtype=rows.dtype) for o in self.outs]  # [M, out] each
        if not rows.shape[0]:  # a forward whose rows all prefill asks the LM head for none
            return ys
        into = (ctypes.c_void_p * len(ys))(*(y.data_ptr() for y in ys))
        bf16 = int(rows.dtype == torch.bfloat16)
        n, m, width = len(ys), rows.shape[0], rows.shape[1]
        scale, eps = (None, 0.0) if norm is None else (norm.weight.data_ptr(), norm.eps)
        if lib.kquant_mm_many(
            n, self._kinds, self._pointers, self._outs, width, rows.data_ptr(), m, into, bf16, threads, scale, eps
        ):
            raise RuntimeError(f"the GGUF kernel refused {m} rows of {width} inputs")
        return ys


def matmul(kind: int, packed: torch.Tensor, out: int, rows: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """rows [M, in] float32 or bfloat16 -> [M, out] in their dtype, through weights `pack` laid out."""
    return Weights([kind], [packed], [out])(rows, threads)[0]


@dataclass(frozen=True)
class Norm:
    """An RMS norm (Llama's, Qwen2's) the kernel applies to its input rows: x / sqrt(mean(x^2) + eps) * weight, in
    float32, summed in its own fixed order (kquant_common.h's `normalized_rows`)."""

    weight: torch.Tensor  # [in] float32, contiguous
    eps: float

    @staticmethod
    def of(norm: torch.nn.Module) -> Norm:
        """A model's norm module (`LlamaRMSNorm`, `Qwen2RMSNorm`: `weight`, `variance_epsilon`), as the kernel
        takes it."""
        weight = norm.weight.detach().float().contiguous()  # type: ignore[operator]
        return Norm(weight, float(norm.variance_epsilon))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Joint:
    """GGUF Linear layers of one input, computed by one kernel call (`KQuantLinear.joint`); with `norm`, of the
    input normalized by it, which the call applies as it reads the input."""

    weights: Weights
    biases: list[torch.Tensor | None]  # [out] each, or None
    in_features: int
    norm: Norm | None = None

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:  # [..., in] -> per layer [..., out]
        rows = x.reshape(-1, self.in_features)  # [M, in]
        ys = self.weights(rows, _threads or torch.get_num_threads(), self.norm)
        return [
            (y if b is None else y + b).reshape(*x.shape[:-1], y.shape[-1])
            for y, b in zip(ys, self.biases, strict=True)
        ]


class KQuantLinear(torch.nn.Module):
    """y = x W^T + b with W a GGUF tensor at its stored precision (x: [..., in], float32 or bfloat16), on
    torch's thread count at the call (`borrowing`'s inside its block)."""

    batch_invariant = True  # a row's outputs never depend on the call's other rows (`invariant.make_deterministic`)
    packed: torch.Tensor  # [tiles, tile bytes] uint8: `pack`'s layout

    def __init__(
        self, kind: int, packed: torch.Tensor, shape: tuple[int, int], bias: torch.Tensor | None, dtype: torch.dtype
    ) -> None:
        """`packed`: the weight [out, in] = `shape` in format `kind`, in `pack`'s layout."""
        super().__init__()
        self.kind = kind
        self.out_features, self.in_features = shape
        self.register_buffer("packed", packed, persistent=False)
        self.bias = bias  # [out] or None
        # the shape and the activations' dtype alone (a plain attribute: `Module.to` has no data to move)
        self.weight = torch.empty(self.out_features, self.in_features, dtype=dtype, device="meta")

    @staticmethod
    def of(codes: Codes, bias: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> KQuantLinear:
        """The layer of decoded `codes` (`pack`ed here)."""
        out, inputs = codes.codes.shape
        return KQuantLinear(codes.kind, pack(codes), (out, inputs), bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return self._alone(x)[0]

    @functools.cached_property
    def _alone(self) -> Joint:
        return self.joint()

    def joint(self, *others: KQuantLinear, norm: Norm | None = None) -> Joint:
        """This layer and `others` (of the same input width) as one kernel call: x -> each one's y (with `norm`, of
        x normalized by it). It holds the packed weights as they are now (a buffer replaced later is not seen)."""
        layers = (self, *others)
        if any(m.in_features != self.in_features for m in layers):
            raise ValueError(f"joint layers take one input width: {[m.in_features for m in layers]}")
        if norm is not None and norm.weight.shape != (self.in_features,):
            raise ValueError(f"a norm of {tuple(norm.weight.shape)} before layers of {self.in_features} inputs")
        weights = Weights([m.kind for m in layers], [m.packed for m in layers], [m.out_features for m in layers])
        return Joint(weights, [m.bias for m in layers], self.in_features, norm)

    def extra_repr(self) -> str:
        return f"{NAMES[self.kind]}, in_features={self.in_features}, out_features={self.out_features}"
