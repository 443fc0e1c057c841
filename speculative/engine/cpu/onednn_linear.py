"""A model's Linear layers through oneDNN with prepacked weights, on the CPU (`cpu_linear: onednn`).

float32: torch's Linear calls MKL's sgemm, which on AMD CPUs takes a generic path: a Linear over a few
rows costs several times its 1-row call. oneDNN with the weight reordered once, at load, for inputs of
about `ROWS` rows (its blocked layout) costs about twice the 1-row call there (`bench/cpu_linear.py`):
a verify of a few draft tokens, and a prompt's prefill, get much cheaper next to a decode step. The
sums run in another order than MKL's, so logits differ from the unpacked model's by float32 rounding
(~1e-4 on Qwen 1.5B); every forward of the model, plain decoding and verification alike, runs the
same kernels.

bfloat16 (where oneDNN computes it natively: AVX-512 BF16, AMX): torch's Linear already runs oneDNN's
kernel, but reorders the weight into that kernel's layout on every call; reordered once at load, the
same kernel computes the same bits (`tests/unit/test_cpu_linear.py`) without that pass. On a Xeon with
AMX a Qwen 1.5B decode step goes from ~380 to ~290 ms and a 64-token prefill from ~590 to ~420 ms.

A tied LM head gets its own packed copy (the input embedding keeps the original): Qwen 1.5B's costs
0.9 GB more in float32, 0.47 GB in bfloat16.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

from speculative.engine.cpu.linears import replaced

ROWS = 8  # the rows the weights are laid out for: a verify's tree (and prefill chunks use the same layout)


class PackedLinear(torch.nn.Module):
    """y = x W^T + b with W held in oneDNN's layout for ROWS-row inputs (x: [..., in_features]; float32 or
    bfloat16, as W)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()  # [out, in]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, ROWS)  # oneDNN's blocked [out, in]
        self.bias = None if linear.bias is None else linear.bias.detach().clone()  # [out]
        # [out, in] the shape alone, for readers of a Linear's weight shape (`ModelRunner`'s vocab size); the
        # values live in `packed` only, so a caller computing with it fails instead of reading a second copy
        self.weight = torch.empty(weight.shape, dtype=weight.dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")  # [..., out]

    def __getstate__(self) -> dict[str, Any]:
        """Pickled and deep-copied with the weight in its plain layout: oneDNN's blocked tensor is opaque (no
        storage to copy); `__setstate__` packs it again."""
        state = self.__dict__.copy()
        state["packed"] = self.packed.to_dense()  # [out, in]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.packed, ROWS)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


M = TypeVar("M", bound=torch.nn.Module)


def native_bf16(device: str) -> bool:
    """Whether `device` computes bfloat16 matmuls natively: a CUDA device, or a CPU whose oneDNN has bf16
    kernels (AVX-512 BF16, AMX). Elsewhere (AVX2 CPUs) a bf16 Linear is emulated and slower than a float32
    one (docs/models.md has the figures)."""
    if device.startswith("cuda"):
        return True
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packable(weight: torch.Tensor) -> bool:
    """Whether a Linear with this weight runs packed: on the CPU, float32, or bfloat16 where oneDNN computes
    it natively (elsewhere torch emulates bfloat16 and its own path stays)."""
    if weight.device.type != "cpu":
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and native_bf16("cpu"))


def packed(model: M, mode: str) -> M:
    """`model` with every `packable` Linear replaced by a `PackedLinear` (`mode` "onednn"; "torch":
    unchanged). Other layers (float16, GPU, quantized) are left as they are."""
    if mode == "torch":
        return model
    if mode != "onednn":
        raise ValueError(f"cpu_linear: expected 'torch' or 'onednn', got {mode!r}")
    if not torch.backends.mkldnn.is_available():
        raise ValueError("cpu_linear: 'onednn' needs a torch built with oneDNN (torch.backends.mkldnn)")
    return replaced(model, lambda linear: PackedLinear(linear) if packable(linear.weight) else None)
