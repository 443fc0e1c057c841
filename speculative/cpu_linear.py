"""A float32 model's Linear layers through oneDNN with prepacked weights, on the CPU (`cpu_linear: onednn`).

torch's float32 Linear calls MKL's sgemm, which on AMD CPUs takes a generic path: a Linear over a few
rows costs several times its 1-row call. oneDNN with the weight reordered once, at load, for inputs of
about `ROWS` rows (its blocked layout) costs about twice the 1-row call there (`bench/cpu_linear.py`):
a verify of a few draft tokens, and a prompt's prefill, get much cheaper next to a decode step. The
sums run in another order than MKL's, so logits differ from the unpacked model's by float32 rounding
(~1e-4 on Qwen 1.5B); every forward of the model, plain decoding and verification alike, runs the
same kernels. A tied LM head gets its own packed copy (the input embedding keeps the original): Qwen
1.5B's costs 0.9 GB more.
"""

from __future__ import annotations

from typing import TypeVar

import torch

ROWS = 8  # the rows the weights are laid out for: a verify's tree (and prefill chunks use the same layout)


class PackedLinear(torch.nn.Module):
    """y = x W^T + b with W held in oneDNN's layout for ROWS-row inputs (x: [..., in_features])."""

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

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


M = TypeVar("M", bound=torch.nn.Module)


def packed(model: M, mode: str) -> M:
    """`model` with every float32 CPU Linear replaced by a `PackedLinear` (`mode` "onednn"; "torch":
    unchanged). Other dtypes are left to torch (its bf16 Linear already runs on oneDNN)."""
    if mode == "torch":
        return model
    if mode != "onednn":
        raise ValueError(f"cpu_linear: expected 'torch' or 'onednn', got {mode!r}")
    if not torch.backends.mkldnn.is_available():
        raise ValueError("cpu_linear: 'onednn' needs a torch built with oneDNN (torch.backends.mkldnn)")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            linear = child if isinstance(child, torch.nn.Linear) else None
            if linear is not None and linear.weight.dtype == torch.float32 and linear.weight.device.type == "cpu":
                setattr(parent, name, PackedLinear(linear))
    return model
