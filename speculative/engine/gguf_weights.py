"""A loaded model's Linear layers on its GGUF file's quantized tensors, at their stored precision (CPU).

The model folders of the registry (`modelstore`) keep the GGUF file the weights were converted from. Where a
Linear layer's tensor there has a kernel (`cpu.kquant`: Q4_K, Q6_K, Q8_0), the layer becomes a `KQuantLinear`
reading those bytes, and its dense weight is dropped; other layers (other formats, the embeddings) stay dense.
The model is then "the quantized model as specserve computes it": speculation keeps its output exactly.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from speculative.engine.cpu import huge_pages, kquant
from speculative.engine.gguf_tensors import GGUFTensor, read_tensors

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# GGUF tensor name (blk.{i}. prefix for a layer's) -> the Hugging Face module it holds the weight of
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
ARCHITECTURES = {"qwen2", "llama"}  # whose GGUF tensors map onto Hugging Face's modules as above
CHECKED_ROWS = 8  # rows of each tensor compared with the model's dense weight at load


@dataclass(frozen=True)
class StoredWeights:
    """What `use_stored` did: the layers it moved, by GGUF type, and the layers left dense, by reason."""

    moved: Counter[str]
    dense: Counter[str]

    def describe(self) -> str:
        moved = ", ".join(f"{n} {kind}" for kind, n in sorted(self.moved.items())) or "none"
        dense = ", ".join(f"{n} {why}" for why, n in sorted(self.dense.items()))
        return f"Linear layers at stored precision: {moved}" + (f"; dense: {dense}" if dense else "")


def gguf_file(folder: str | Path) -> Path | None:
    """The one GGUF file in a model folder, or None."""
    found = sorted(Path(folder).glob("*.gguf")) if Path(folder).is_dir() else []
    return found[0] if len(found) == 1 else None


def unavailable(folder: str | Path, model: PreTrainedModel) -> str | None:
    """Why `model` (loaded from `folder`) cannot have stored-precision weights here, or None where it can."""
    if kquant.library() is None:
        return "the GGUF kernels need an x86 CPU with AVX2 and FMA (or AVX-512 VNNI) and a C compiler"
    if next(model.parameters()).device.type != "cpu":
        return "stored-precision weights run on the CPU"
    if next(model.parameters()).dtype not in (torch.float32, torch.bfloat16):
        return "stored-precision weights take float32 or bfloat16 activations"
    if gguf_file(folder) is None:
        return f"{folder} holds no single GGUF file"
    if getattr(model.config, "model_type", None) not in ARCHITECTURES:
        return f"no GGUF tensor map for architecture {getattr(model.config, 'model_type', None)!r}"
    return None


def _rows(out: int, name: str, config: object) -> torch.Tensor | None:
    """The order of a GGUF tensor's `out` rows as Hugging Face holds them: llama's GGUF stores q and k rows
    permuted for its rotary layout (transformers un-permutes them on load); None where rows map as they are."""
    if getattr(config, "model_type", None) != "llama" or name not in ("attn_q", "attn_k"):
        return None
    heads = int(getattr(config, "num_attention_heads" if name == "attn_q" else "num_key_value_heads"))
    return torch.arange(out).reshape(heads, out // heads // 2, 2).transpose(1, 2).reshape(-1)


@dataclass(frozen=True)
class _Move:
    """A Linear layer and the GGUF tensor it moves onto."""

    target: str  # the layer's module path
    tensor: GGUFTensor
    order: torch.Tensor | None  # the file's rows in the layer's order (`_rows`)
    layer: torch.nn.Linear

    @property
    def nbytes(self) -> int:
        return kquant.packed_bytes(int(self.tensor.tensor_type), self.layer.out_features, self.layer.in_features)


def use_stored(model: PreTrainedModel, path: Path) -> StoredWeights:
    """Moves `model`'s Linear layers onto the quantized tensors of GGUF file `path` (in place), each checked
    against the model's dense weight (its first rows) so a mismatched file fails loudly. The tiles every step
    streams are laid out side by side in one arena on 2 MiB pages, where the OS has them (`huge_pages`)."""
    modules = dict(model.named_modules())
    moves: list[_Move] = []
    dense: Counter[str] = Counter()
    for tensor in read_tensors(path):
        parts = tensor.name.split(".")
        if tensor.name == "output.weight":
            target, short = "lm_head", "output"
        elif parts[0] == "blk" and len(parts) == 4 and parts[3] == "weight" and parts[2] in LAYER_TENSORS:
            target, short = f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}", parts[2]
        else:
            continue
        layer = modules.get(target)
        if not isinstance(layer, torch.nn.Linear):
            dense[f"{short} (no Linear {target})"] += 1
            continue
        kind, inputs = int(tensor.tensor_type), int(tensor.shape[0])
        if not kquant.takes(kind, inputs):
            dense[f"{tensor.tensor_type.name} (no kernel)"] += 1
            continue
        shape = (tensor.data.shape[0], inputs)
        if shape != layer.weight.shape:
            raise ValueError(f"{path.name}: {tensor.name} is {shape}, {target} {tuple(layer.weight.shape)}")
        order = _rows(tensor.data.shape[0], short, model.config)
        first = np.arange(min(CHECKED_ROWS, shape[0])) if order is None else order[:CHECKED_ROWS].numpy()
        _check(kquant.decode(kind, tensor.data[first], inputs), layer.weight, f"{path.name}: {tensor.name}")
        moves.append(_Move(target, tensor, order, layer))
    places = {name: i for i, name in enumerate(modules)}
    moves.sort(key=lambda m: places[m.target])  # in the model's order, as its forwards read them
    for m, packed in zip(moves, huge_pages.carve([m.nbytes for m in moves]), strict=True):
        kind, (out, inputs) = int(m.tensor.tensor_type), m.layer.weight.shape
        kquant.pack_stored(kind, m.tensor.data, inputs, m.order, packed)
        bias = None if m.layer.bias is None else m.layer.bias.detach()
        stored = kquant.KQuantLinear(kind, packed, (out, inputs), bias, m.layer.weight.dtype)
        parent, _, child = m.target.rpartition(".")
        setattr(modules[parent] if parent else model, child, stored)
    return StoredWeights(Counter(m.tensor.tensor_type.name for m in moves), dense)


def _check(first: kquant.Codes, weight: torch.Tensor, what: str) -> None:
    """A tensor's first rows, decoded, stand for the model's dense weight (converted from this file), to its dtype."""
    rows = first.codes.shape[0]
    if not torch.equal(kquant.dequantize(first).to(weight.dtype), weight.detach()[:rows]):
        raise ValueError(f"{what} does not hold the model's weight (another file, or rows in another order)")
