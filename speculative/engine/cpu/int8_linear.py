"""A float32 draft model's Linear layers with int8 weights (CPU), on torch's own int8 kernels.

A draft step reads every weight once for one to a few tokens, so its cost is the bytes it reads: int8 weights,
one scale per output channel (the channel's largest |w| over 127), read a quarter of float32's. Two of torch's
kernels multiply them, chosen per call by its rows:
- up to `int8_avx2.MAX_ROWS` rows (a draft step, a small tree), where the CPU has AVX2 and FMA: our kernel
  (`int8_avx2`), float32 rows times weights widened once per call;
- elsewhere up to `FEW_ROWS` rows: `aten._weight_int8pack_mm`, weight-only, the activations and outputs in
  bfloat16 (its vectorized kernels take bfloat16; its float32 one is scalar C++);
- more (a prompt's catch-up): oneDNN's int8 matmul (`onednn::qlinear_pointwise`, what Inductor lowers x86 int8
  Linear layers to) on a copy of the weights packed once at load, float32 out, the rows quantized per call to
  7-bit unsigned codes with one scale and zero point (AVX2's u8 x s8 instruction adds pairs of products in
  int16, which 8-bit codes overflow; fbgemm's dynamic Linear reduced the range the same way).
`_weight_int8pack_mm` converts every weight to float as it multiplies, once per row: from ~6 rows oneDNN's
kernel is cheaper; below, it costs about twice as much per call.

Both take plain int8 tensors and float scales: none of torch's quantized dtypes (`torch.qint8`), deprecated with
`torch.ao.quantization` and the fbgemm dynamic Linear that needs them (`tests/unit/test_int8_linear.py` keeps
them out). For draft models only: a draft's tokens are proposals, so its weights change how many are accepted,
never the output.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

from speculative.engine.cpu import int8_avx2
from speculative.engine.cpu.linears import replaced

FEW_ROWS = 5  # most rows a call runs through `_weight_int8pack_mm`; more through oneDNN's int8 matmul
ALIGN = 16  # inputs per vector of the int8pack kernel (AVX-512; AVX2's 8): layers of other widths stay float32
LEVELS = 127  # symmetric int8 weights in -127..127; activations (oneDNN's path) in 0..127


class Int8Linear(torch.nn.Module):
    """y = x W^T + b with W as int8 [out, in] times a per-output scale (x: [..., in] float32)."""

    qweight: torch.Tensor | None  # [out, in] int8, for torch's few-row kernel (None where ours runs instead)
    scale: torch.Tensor  # [out] bfloat16 (`_weight_int8pack_mm`'s dtype; oneDNN reads it as float32)

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()  # [out, in]
        # the scale rounded to bfloat16 first, so the codes are the grid the kernels multiply by
        scale = (weight.abs().amax(1) / LEVELS).clamp_min(torch.finfo(torch.float32).tiny).to(torch.bfloat16)
        codes = torch.round(weight / scale.float()[:, None]).clamp(-LEVELS, LEVELS).to(torch.int8)  # [out, in]
        self.register_buffer("scale", scale, persistent=False)
        self.bias = None if linear.bias is None else linear.bias.detach().float()  # [out]
        # One copy of the codes for the few-row kernel: ours (AVX2) where it runs, else torch's
        self.tiled: torch.Tensor | None = None  # [tiles, in, 8] int8: our AVX2 kernel's layout
        self.register_buffer("qweight", None, persistent=False)
        if int8_avx2.library() is not None:
            self.tiled = int8_avx2.pack(codes)
            self.tiled_scale = int8_avx2.padded(scale)  # [tiles * 8] float32
            self.tiled_bias = int8_avx2.padded(torch.zeros(weight.shape[0]) if self.bias is None else self.bias)
        else:
            self.qweight = codes.contiguous()
        # [out, in] the shape alone, for readers of a Linear's weight shape (`ModelRunner`'s vocab size)
        self.weight = torch.empty(weight.shape, dtype=torch.float32, device="meta")
        self._pack()

    def codes(self) -> torch.Tensor:
        """The int8 weights [out, in], from whichever copy this layer keeps."""
        if self.qweight is not None:
            return self.qweight
        assert self.tiled is not None
        return self.tiled.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]

    def torch_kernels_only(self) -> None:
        """Runs torch's kernels alone from now on, as where the CPU lacks AVX2 or the install our kernel."""
        self.qweight, self.tiled = self.codes().contiguous(), None

    def _pack(self) -> None:
        """oneDNN's layout of the codes (an opaque tensor: not a buffer, so `Module.to` and pickling skip it)."""
        self.packed = torch.ops.onednn.qlinear_prepack(self.codes(), None)  # [in, out] blocked
        self.zeros = torch.zeros(self.out_features, dtype=torch.int32)  # [out] symmetric weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, self.in_features)  # [M, in]
        if self.tiled is not None and rows.shape[0] <= int8_avx2.MAX_ROWS:
            y = int8_avx2.matmul(self.tiled, self.out_features, rows.float(), self.tiled_scale, self.tiled_bias)
            y = y.to(x.dtype)
        elif self.qweight is not None and rows.shape[0] <= FEW_ROWS:
            half = rows.to(torch.bfloat16, copy=True)  # a fresh buffer: the AVX-512 kernel loads rows aligned
            scale = self.scale.to(torch.bfloat16)  # itself, unless a `Module.to(dtype)` converted it
            y = torch._weight_int8pack_mm(half, self.qweight, scale).to(x.dtype)  # [M, out]
            if self.bias is not None:
                y = y + self.bias
        else:
            y = self._many(rows)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _many(self, rows: torch.Tensor) -> torch.Tensor:  # [M, in] float32 -> [M, out] float32
        low, high = (float(v) for v in rows.detach().aminmax())  # (the int8 path has no gradient)
        low, high = min(low, 0.0), max(high, 0.0)  # zero on the grid
        step = max((high - low) / LEVELS, torch.finfo(torch.float32).tiny)
        zero = round(-low / step)
        codes = torch.clamp(torch.round(rows / step) + zero, 0, LEVELS).to(torch.uint8)  # [M, in]
        scale = self.scale.float()  # [out]
        return torch.ops.onednn.qlinear_pointwise(
            codes, step, zero, self.packed, scale, self.zeros, self.bias, 1.0, 0, torch.float32, "none", [], ""
        )

    def __getstate__(self) -> dict[str, Any]:
        """Pickled and deep-copied without oneDNN's opaque copy (no storage to copy); `__setstate__` packs it."""
        state = self.__dict__.copy()
        del state["packed"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._pack()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


M = TypeVar("M", bound=torch.nn.Module)


def int8_quantized(model: M) -> M:
    """`model` (float32, CPU) with every Linear whose inputs fill the kernel's vectors (in_features a multiple
    of ALIGN) replaced by an `Int8Linear`, the LM head too (a tied head gets its own int8 copy; the input
    embeddings stay float32); others (seen only in tiny test models) stay float32."""
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32:
        raise ValueError("quantize: 'int8' needs a float32 model on the CPU")
    return replaced(model, lambda linear: Int8Linear(linear) if linear.in_features % ALIGN == 0 else None)
