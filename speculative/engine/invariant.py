"""Batch-invariant target forwards (`target_pool.deterministic`): every row of a forward is computed the
same way whether it is a one-token step, one of a verify's k + 1 rows, a node of a tree, or a row beside
other sequences' rows, so speculation and batching never change greedy output, in bfloat16 as in float32.

A forward's shape changes a row's result only where a kernel picks its summation order by shape:
- **Linear layers.** oneDNN (bfloat16) and MKL (float32) choose a kernel by the number of rows, and with
  it the order in which a row's products are summed: a one-row call sums in another order than a call of
  several rows, which all sum alike from some count up (2 for oneDNN's bfloat16 kernels, measured at load
  by `linear_rows`). `InvariantLinear` gives every call at least that many rows: a one-token step is
  padded with a zero row, which costs nothing where a forward reads weights rather than computes.
- **Attention.** SDPA's CPU kernels split the keys by the query count and the cache's length, and merge
  the blocks' partial sums in that split. `invariant_attention` computes it in float32 over blocks of
  BLOCK key columns that always start at column 0 (the last block padded and masked), merging them by an
  online softmax in block order; its matmuls always see at least `MIN_ROWS` query rows, BLOCK keys and
  the head's width (`attention_invariant` checks the float32 matmuls at load). A row's sums then depend
  on its own query, keys and values alone, and blocks past its keys add exact zeros (so a batch padded
  to a longer row changes nothing).
- Norms, rotary embeddings, activations and residual adds work per row or per element: nothing to do.

So a prompt's keys and values are the same whatever prefill chunk the scheduler picks, and a verify row's
logits equal the one-token step's bit for bit. The draft model needs none of this: drafts never change
the output.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from speculative.engine.cpu import attention as cpu_attention
from speculative.engine.cpu.onednn_linear import PackedLinear

MIN_ROWS = 16  # query rows every attention matmul sees (a multiple of the widest vector: no scalar tails)
LINEAR_ROWS = (2, 4, 8, 16)  # the fewest rows a Linear call may be given, tried in this order at load
BLOCK = 256  # key columns per attention block
LINEARS = (torch.nn.Linear, PackedLinear)  # the layers `InvariantLinear` wraps
INVARIANT = "_specserve_invariant"  # an attention module's attribute: computed by `invariant_attention`


class InvariantLinear(torch.nn.Module):
    """A Linear layer (torch's, or `onednn_linear.PackedLinear`) whose calls always carry at least `min_rows`
    rows, so every row is summed by the same kernel whatever the call's row count."""

    def __init__(self, inner: torch.nn.Module, min_rows: int) -> None:
        super().__init__()
        self.inner, self.min_rows = inner, min_rows
        self.in_features: int = inner.in_features  # type: ignore[assignment]
        self.out_features: int = inner.out_features  # type: ignore[assignment]

    @property
    def weight(self) -> Any:
        """The inner layer's weight (its shape: `ModelRunner` reads the vocabulary off the LM head)."""
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, x.shape[-1])  # [R, in]
        if rows.shape[0] >= self.min_rows or not rows.shape[0]:  # (no rows: a forward whose rows all prefill)
            return self.inner(x)
        padded = torch.cat([rows, rows.new_zeros(self.min_rows - rows.shape[0], rows.shape[1])])  # [min_rows, in]
        return self.inner(padded)[: rows.shape[0]].reshape(*x.shape[:-1], -1)


def make_invariant(model: torch.nn.Module, min_rows: int) -> torch.nn.Module:
    """`model` with every Linear layer wrapped (`InvariantLinear`, calls of at least `min_rows` rows) and every
    attention module tagged for `invariant_attention` (what `packing.packed_attention` runs for a tagged
    module), in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LINEARS):
                setattr(parent, name, InvariantLinear(child, min_rows))
        if hasattr(parent, "num_key_value_groups"):  # transformers' attention modules
            setattr(parent, INVARIANT, True)
    return model


def invariant_attention(
    query: torch.Tensor,  # [b, heads, m, D]
    kv: tuple[torch.Tensor, torch.Tensor],  # key, value: [b, kv_heads, C, D] each
    mask: torch.Tensor,  # [b, 1, g * m, C] additive: each query's mask row, repeated per folded head
    scaling: float,
) -> torch.Tensor:  # [b, m, heads, D] in the query's dtype
    """Attention with each row's sums fixed by the row alone (module docstring): the query heads of each KV
    head folded into one block of g * m rows (head kv * g + r, query i -> row r * m + i), padded to a
    multiple of MIN_ROWS, against BLOCK-column blocks of keys merged by an online softmax. On a CPU with
    AVX-512 one C call computes it instead (`cpu.attention`: every row alone, its columns in order; equal to
    this to rounding, invariant alike, and chosen per process, so every forward of a replica runs the same
    one), which a forward of few tokens spends far less on; the torch formulation elsewhere."""
    key, value = kv
    if (fast := cpu_attention.attend(query, key, value, mask, scaling)) is not None:
        return fast
    b, heads, m, dim = query.shape
    kv_heads, columns = key.shape[1], key.shape[2]
    rows = heads // kv_heads * m
    padded = -(-rows // MIN_ROWS) * MIN_ROWS
    q = query.reshape(b, kv_heads, rows, dim).float() * scaling  # [b, kv, rows, D]
    q = torch.cat([q, q.new_zeros(b, kv_heads, padded - rows, dim)], dim=2)  # [b, kv, R, D]
    bias = mask.float()  # [b, 1, rows, C]
    bias = torch.cat([bias, bias.new_zeros(b, 1, padded - rows, columns)], dim=2)  # [b, 1, R, C]
    top = q.new_full((b, kv_heads, padded, 1), -math.inf)  # [b, kv, R, 1] the running maximum
    acc = q.new_zeros(b, kv_heads, padded, dim + 1)  # [b, kv, R, D + 1] weighted values, then the weights' sum
    ones = q.new_ones(b, kv_heads, BLOCK, 1)
    for start in range(0, columns, BLOCK):
        k, v, add = _block(key, start), _block(value, start), _block_bias(bias, start)
        scores = q @ k.transpose(-1, -2) + add  # [b, kv, R, BLOCK]
        new_top = torch.maximum(top, scores.amax(-1, keepdim=True))
        weights = torch.exp(scores - new_top)  # [b, kv, R, BLOCK]
        acc = acc * torch.exp(top - new_top) + weights @ torch.cat([v, ones], dim=-1)  # [b, kv, R, D + 1]
        top = new_top
    out = acc[..., :dim] / acc[..., dim:]  # [b, kv, R, D]
    out = out[:, :, :rows].reshape(b, kv_heads, heads // kv_heads, m, dim)  # [b, kv, g, m, D]
    return out.permute(0, 3, 1, 2, 4).reshape(b, m, heads, dim).to(query.dtype)


def _block(states: torch.Tensor, start: int) -> torch.Tensor:  # [b, kv, C, D] -> [b, kv, BLOCK, D] float32
    part = states[:, :, start : start + BLOCK].float()
    short = BLOCK - part.shape[2]
    return part if not short else torch.cat([part, part.new_zeros(*part.shape[:2], short, part.shape[3])], dim=2)


def _block_bias(bias: torch.Tensor, start: int) -> torch.Tensor:  # [b, 1, R, C] -> [b, 1, R, BLOCK]
    part = bias[..., start : start + BLOCK]
    short = BLOCK - part.shape[-1]
    if not short:
        return part
    return torch.cat([part, part.new_full((*part.shape[:-1], short), torch.finfo(torch.float32).min)], dim=-1)


LINEAR_COUNTS = (3, 5, 8, 9, 16, 17, 40, 83, 256)  # row counts a Linear check compares (chunks reach 256)
ATTENTION_COUNTS = (MIN_ROWS, 2 * MIN_ROWS, 3 * MIN_ROWS, 6 * MIN_ROWS, 16 * MIN_ROWS)  # attention's padded counts


def linear_rows(layers: list[torch.nn.Module]) -> int | None:
    """The fewest rows (of LINEAR_ROWS) from which these layers, as loaded, sum a row alike at every row
    count (each layer's own kernel, dtype and layout; one layer per distinct shape is enough); None: no
    such count on this machine's kernels (the forwards cannot be made batch invariant here)."""
    generator = torch.Generator().manual_seed(0)
    inputs = []
    for layer in layers:
        dtype, device = _placement(layer)
        x = torch.randn(max(LINEAR_COUNTS), int(layer.in_features), generator=generator)  # type: ignore[arg-type]
        inputs.append(x.to(dtype=dtype, device=device))
    with torch.no_grad():
        for rows in LINEAR_ROWS:
            counts = (rows, *(n for n in LINEAR_COUNTS if n > rows))
            if all(_alike(lambda n, f=f, x=x: f(x[:n])[:1], counts) for f, x in zip(layers, inputs, strict=True)):
                return rows
    return None


def attention_invariant(head_dims: tuple[int, ...] = (64, 128)) -> bool:
    """Whether `invariant_attention`'s float32 matmuls sum a row alike at every query count from MIN_ROWS up
    (scores over a head's width, weighted values over BLOCK keys)."""
    generator = torch.Generator().manual_seed(0)
    for inner, outer in [(d, BLOCK) for d in head_dims] + [(BLOCK, d + 1) for d in head_dims]:
        a = torch.randn(1, 2, max(ATTENTION_COUNTS), inner, generator=generator)
        w = torch.randn(1, 2, inner, outer, generator=generator)
        if not _alike(lambda n, a=a, w=w: (a[:, :, :n] @ w)[:, :, :1], ATTENTION_COUNTS):
            return False
    return True


def _alike(first_row: Any, counts: tuple[int, ...]) -> bool:
    """`first_row(n)` is the same tensor, bit for bit, at every count."""
    reference = first_row(counts[0])
    return all(torch.equal(first_row(n), reference) for n in counts[1:])


def make_deterministic(model: torch.nn.Module) -> str | None:
    """Make `model`'s forwards batch invariant on this machine's kernels (in place); None when done, else why
    they cannot be here (the model is then left as it was)."""
    layers: dict[tuple[int, int, torch.dtype], torch.nn.Module] = {}
    if any(type(m).__name__ == "Conv1D" for m in model.modules()):
        return "GPT-2's Conv1D projections are not made invariant (Llama, Qwen2 and their kind are)"
    for module in model.modules():
        if isinstance(module, LINEARS):
            dtype, _ = _placement(module)
            layers.setdefault((module.in_features, module.out_features, dtype), module)  # type: ignore[arg-type]
    invariant_by_construction = any(getattr(m, "batch_invariant", False) for m in model.modules())
    if not layers and not invariant_by_construction:
        return "no Linear layers to make invariant (a tensor-parallel shard's layers are DeepSpeed's)"
    rows = linear_rows(list(layers.values())) if layers else 1
    if rows is None:
        return f"this machine's Linear kernels sum a row differently at every row count up to {LINEAR_ROWS[-1]}"
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", 1)
    head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 64) // heads
    if not attention_invariant((head_dim,)):
        return "this machine's float32 matmuls sum a row differently by the number of rows"
    make_invariant(model, rows)
    return None


def _placement(layer: torch.nn.Module) -> tuple[torch.dtype, torch.device]:
    """A Linear layer's weight dtype and device (a `PackedLinear`'s weight is a meta tensor of its shape)."""
    weight = layer.weight
    assert isinstance(weight, torch.Tensor)
    return weight.dtype, torch.device("cpu") if weight.device.type == "meta" else weight.device
