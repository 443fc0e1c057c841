"""A bfloat16 draft model's Linear layers with a 4-bit copy of their weights for decode-sized forwards (CPU).

A draft step reads every weight once for one to a few tokens, so its cost is the bytes it reads. 4-bit
weights in groups of `GROUP` inputs, each group with its own scale and minimum, read a quarter of bfloat16's
bytes. Two kernels multiply them, chosen once per layer: on a CPU with AVX-512 VNNI and a single torch
thread (a draft worker's), `int4_vnni` (int8 activations, the weights streamed once); elsewhere torch's
weight-only kernel (`aten._weight_int4pack_mm_for_cpu`, bfloat16 activations, torch's threads). Past a few
rows both lose to bfloat16's AMX kernels (they redo their work per row: with torch's kernel 24 layers of 8
rows cost about bfloat16's, of 32 rows three times), so a forward of more than `MAX_ROWS` rows (a prompt's
catch-up, a wide tree) runs on the bfloat16 weights the layer keeps: decode at int4's cost, prefill at
bfloat16's speed (oneDNN's kernel on the weight reordered once, `cpu_linear.PackedLinear`, where it runs
natively: an 80-token catch-up of Qwen 0.5B takes ~150 ms instead of ~200 ms with torch's Linear).

On a CPU without native bfloat16 (AVX2 only) the draft stays float32 and its layers become Q4_1 weights of the
same grid (`kquant.from_grid`, scale and minimum in float16) on the AVX2 GGUF kernel (`kquant`), which takes
every row count: a catch-up too, int8 activations at maddubs' rate instead of bfloat16 emulated.

Groups of 32 with a min/max affine grid hold a Q4_K GGUF tensor (the project's default models) almost
exactly: Q4_K stores each 32-weight block as 16 levels of one scale above one minimum. For draft models
only: a draft's tokens are proposals, so its weights change how many are accepted, never the output.
"""

from __future__ import annotations

from typing import Literal, TypeVar

import torch

from speculative.engine.cpu import huge_pages, int4_vnni, kquant
from speculative.engine.cpu.linears import replaced
from speculative.engine.cpu.onednn_linear import PackedLinear, packable

GROUP = int4_vnni.GROUP  # inputs per scale and minimum (Q4_K's block; both kernels take 32)
MAX_ROWS = int4_vnni.MAX_ROWS  # most rows a forward runs on the int4 weights (the VNNI kernel's most); more on bfloat16
LEVELS = 15  # 4 bits: quantized values 0..15
Kernel = Literal["vnni", "aten"]


class Int4Linear(torch.nn.Module):
    """y = x W^T + b: W as 4-bit groups for inputs of <= MAX_ROWS rows, as bfloat16 beyond (x: [..., in]).
    `kernel`: None picks `int4_vnni` where it runs (built, AVX-512 VNNI, one torch thread), else "aten"."""

    weight: torch.Tensor  # [out, in] bfloat16 (its shape alone, on the meta device, where `dense` holds it)
    packed: torch.Tensor  # the kernel's layout of the 4-bit weights
    scales_zeros: torch.Tensor  # [in / GROUP, out, 2] (torch's kernel only)

    def __init__(self, linear: torch.nn.Linear, kernel: Kernel | None = None) -> None:
        super().__init__()
        weight = linear.weight.detach()  # [out, in] bfloat16
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else linear.bias.detach()  # [out]
        # a flag, not the library, so the layer pickles and copies; "aten" neither builds nor probes the kernel
        self.vnni = kernel != "aten" and torch.get_num_threads() == 1 and int4_vnni.library() is not None
        if kernel == "vnni" and not self.vnni:
            raise ValueError("int4 kernel 'vnni' asked for, but it cannot run here (CPU, compiler or threads)")
        levels, scale, low = grid(weight)
        if self.vnni:
            packed, scales_zeros = int4_vnni.pack(levels, scale, low), torch.empty(0)
        else:  # torch's convention: w = (q - 8) * scale + zero, so zero = low + 8 * scale; [G, out, 2]
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1)  # [out, in / 2] uint8
            zero = low + 8 * scale
            scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(weight.dtype)
        # for forwards of many rows: the bfloat16 weight packed for oneDNN (a tied head's is a copy), else kept
        # as it is (no copy: a tied head shares the embedding's)
        self.dense = PackedLinear(linear) if packable(weight) else None
        if self.dense is None:
            self.register_buffer("weight", weight, persistent=False)
        else:  # the shape alone (meta), a plain attribute as in PackedLinear: `Module.to` has no data to move
            self.weight = self.dense.weight
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_zeros", scales_zeros, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, self.in_features)  # [M, in]
        if rows.shape[0] > MAX_ROWS:
            if self.dense is not None:
                return self.dense(x)
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if self.vnni:
            y = int4_vnni.matmul(self.packed, self.out_features, rows)  # [M, out]
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kernel = "vnni" if self.vnni else "aten"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {kernel=}"
        )


def grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [out, in] -> levels, scale, low
    """Per group of GROUP inputs: w ~ q * scale + low with q in 0..15 ([out, in] int32), scale = (max - min) / 15
    and low = min ([out, in / GROUP] float32), so the group's min and max are on the grid."""
    out, inp = weight.shape
    groups = weight.float().reshape(out, inp // GROUP, GROUP)  # [out, G, GROUP]
    low, high = groups.amin(-1), groups.amax(-1)  # [out, G]
    scale = ((high - low) / LEVELS).clamp_min(torch.finfo(torch.float32).tiny)  # [out, G]
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, LEVELS).to(torch.int32)
    return q.reshape(out, inp), scale, low


M = TypeVar("M", bound=torch.nn.Module)


def float32_kernel() -> bool:
    """Whether a float32 model's int4 layers run here: the AVX2 GGUF kernel, which takes Q4_1, is built."""
    return kquant.library((kquant.Q4_1,)) is not None


def int4_quantized(model: M, kernel: Kernel | None = None) -> M:
    """`model` (CPU) with every Linear whose inputs come in whole groups on 4-bit weight groups: a bfloat16 model's
    as `Int4Linear`s (`kernel` as it takes it), a float32 model's as Q4_1 `kquant.KQuantLinear`s where
    `float32_kernel`; others (in_features not a multiple of GROUP, seen only in tiny test models) stay as they are."""
    param = next(model.parameters())
    if param.device.type == "cpu" and param.dtype == torch.float32:
        if not float32_kernel():
            raise ValueError(
                "quantize: 'int4' on a float32 model needs the AVX2 GGUF kernel (an x86 CPU, a C compiler)"
            )
        quantized = replaced(model, lambda linear: _q4_1(linear) if linear.in_features % GROUP == 0 else None)
        huge_pages.onto_huge_pages(quantized)  # the tiles every draft step streams, on 2 MiB pages
        return quantized
    if param.device.type != "cpu" or param.dtype != torch.bfloat16:
        raise ValueError("quantize: 'int4' needs a bfloat16 or float32 model on the CPU")
    return replaced(model, lambda linear: Int4Linear(linear, kernel) if linear.in_features % GROUP == 0 else None)


def _q4_1(linear: torch.nn.Linear) -> kquant.KQuantLinear:
    bias = None if linear.bias is None else linear.bias.detach()  # [out]
    return kquant.KQuantLinear.of(kquant.from_grid(*grid(linear.weight.detach())), bias, torch.float32)
