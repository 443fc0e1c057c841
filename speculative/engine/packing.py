"""Packed forwards: a batch's rows of different lengths as one row of their tokens, no padding.

The runner's rows add different numbers of tokens per forward: one for a plain decode, 1 + d for a
sequence drafting d, a whole prompt for one that just joined. Padding every row to the longest makes
the batch's cheapest rows cost as much as its longest: a sequence drafting 4 tokens beside 15 plain
decodes would have the target compute 16 x 5 positions for 16 + 4 tokens of work. Packed, the
projections and MLPs (nearly all of a forward's compute) run on exactly the tokens given, so a
drafted token costs one token's compute whatever the batch, and speculation can pay under load for
the sequences whose drafts land.

Only attention needs rows: each token attends to its own row's cache. So the model runs on
input_ids [1, T] (T = the rows' tokens, concatenated); its cache (`kv_cache.SlotCache`) writes each
layer's packed keys and values into their rows' slots and returns the rows' whole cache
[B, kv_heads, C, D]; and attention (`ATTENTION`, registered with transformers) scatters the queries
into a [rows, m] layout (m = the longest row's new tokens; shorter rows leave masked pads), runs
SDPA with the runner's 4D mask over groups of rows of similar length (`batching.ragged_groups`: a prompt beside
decodes is not padded into their attention, nor they into its; when some rows add one token, every
row's first token goes in one whole-batch call and only the longer rows' rest in groups), and
gathers the outputs back to
[1, T]. Position ids are given per token, so rotary and absolute position embeddings are unchanged.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from speculative.engine.batching import ragged_groups
from speculative.engine.invariant import INVARIANT, invariant_attention

ATTENTION = "specserve_packed"  # the attention implementation a runner sets on its model
_TAG = "_specserve_packing"  # the mask tensor's attribute holding its Packing
ATTENTION_GROUP_OVERHEAD = 8  # rows' worth of query padding one more SDPA call per layer is worth


@dataclass(frozen=True)
class _Block:
    """Some rows as a padded [rows, m] block: where each of their packed tokens goes in it."""

    rows: torch.Tensor  # [b] row indices, ascending
    width: int  # m: the longest of these rows' new tokens
    source: torch.Tensor  # [t] packed positions of these rows' tokens
    target: torch.Tensor | None  # [t] their slots in the flattened [b * m] block; None: no pads (see start)
    start: int  # packed position of the first token (with no pads, the block is tokens start..start+t-1)
    column: int = 0  # the block's first query column in the [B, n] layout (where its mask rows start)

    @staticmethod
    def of(rows: list[int], lengths: list[int], offsets: list[int], device: torch.device, column: int = 0) -> _Block:
        """Rows' tokens column..column+lengths[r]-1 (offsets: each row's first packed position)."""
        m = max(lengths[r] for r in rows)
        source = [offsets[r] + column + j for r in rows for j in range(lengths[r])]
        slots = [i * m + j for i, r in enumerate(rows) for j in range(lengths[r])]
        dense = len(slots) == len(rows) * m and source == list(range(source[0], source[0] + len(source)))
        target = None if dense else _long(slots, device)
        return _Block(_long(rows, device), m, _long(source, device), target, source[0], column)

    def scatter(self, states: torch.Tensor) -> torch.Tensor:  # [1, heads, T, D] -> [b, heads, m, D], zero pads
        heads, dim, rows = states.shape[1], states.shape[3], len(self.rows)
        if self.target is None:
            block = states[0][:, self.start : self.start + rows * self.width]  # [heads, b * m, D]
        else:
            block = states.new_zeros(heads, rows * self.width, dim)
            block[:, self.target] = states[0][:, self.source]
        return block.view(heads, rows, self.width, dim).transpose(0, 1)


@dataclass(frozen=True)
class Packing:
    """Where each packed token sits in the runner's [B, n] layout, and the 4D mask of that layout.

    The model gets `mask` as its attention mask (a 4D mask reaches attention as it is given), tagged
    with the packing, so attention finds it there; the runner sets it on the cache for the forward.
    """

    mask: torch.Tensor  # [B, 1, n, C] additive mask over the cache's columns (the new tokens' included)
    rows: int  # B
    groups: tuple[_Block, ...]  # rows attended together (rows with no new tokens in none)
    _masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, compare=False)

    def group_mask(self, group: int, repeat: int) -> torch.Tensor:  # [b, 1, repeat * m, C]
        """A group's mask rows, repeated `repeat` times along the queries (folded heads): made at the
        first layer that asks, shared by the others."""
        found = self._masks.get((group, repeat))
        if found is None:
            g = self.groups[group]
            cols = slice(g.column, g.column + g.width)
            found = self.mask[:, :, cols] if len(g.rows) == self.rows else self.mask[g.rows, :, cols]
            found = found.repeat(1, 1, repeat, 1) if repeat > 1 else found
            self._masks[(group, repeat)] = found
        return found

    @staticmethod
    def of(lengths: list[int], mask: torch.Tensor, device: torch.device) -> Packing:
        """The packing of rows adding `lengths` new tokens each (row by row, in order; some new token).

        When rows differ and some add one token (a drafting round under load: most rows decode, a
        few verify drafts; or decodes beside a joining prompt), every row's first token is attended
        in one call over the whole batch, the decode step's own shape (no row's cache gathered), and
        only the longer rows' further tokens in groups of their own: a query needs only its own mask
        row, so a row's queries may be split between calls.
        """
        offsets = row_offsets(lengths)
        live = [r for r, n in enumerate(lengths) if n]
        if len({lengths[r] for r in live}) > 1 and min(lengths[r] for r in live) == 1:
            rest = [max(n - 1, 0) for n in lengths]
            firsts = _Block.of(live, [min(n, 1) for n in lengths], offsets, device)
            groups = ragged_groups(rest, ATTENTION_GROUP_OVERHEAD)
            blocks = (firsts, *(_Block.of(sorted(rows), rest, offsets, device, 1) for rows in groups))
        else:
            groups = ragged_groups(lengths, ATTENTION_GROUP_OVERHEAD)
            blocks = tuple(_Block.of(sorted(rows), lengths, offsets, device) for rows in groups)
        mask = mask.to(device)
        pack = Packing(mask, len(lengths), blocks)
        setattr(mask, _TAG, pack)  # a tensor attribute, read back by packed_attention
        return pack


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, T, D] packed, or [B, heads, q, D] unpacked
    key: torch.Tensor,  # [B, kv_heads, C, D]
    value: torch.Tensor,  # [B, kv_heads, C, D]
    attention_mask: torch.Tensor | None,  # a packed forward's: [B, 1, n, C], tagged with its Packing
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # [1, T, heads, D] (or SDPA's own output when not packed)
    """SDPA for packed forwards; any other call (e.g. `generate` on the same model) is plain SDPA."""
    p = getattr(attention_mask, _TAG, None)
    if p is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outputs = []
    groups = getattr(module, "num_key_value_groups", 1)
    invariant = getattr(module, INVARIANT, False)  # batch-invariant forwards (`invariant.make_invariant`)
    for i, g in enumerate(p.groups):
        everyone = len(g.rows) == p.rows  # (rows ascending: then the batch as it is)
        k, v = (key, value) if everyone else (key[g.rows], value[g.rows])
        if invariant:  # every call folds its heads alike, one-token steps too
            scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
            o = invariant_attention(g.scatter(query), (k, v), p.group_mask(i, groups), scaling)  # [b, m, heads, D]
        else:
            fold = groups if groups > 1 and g.width > 1 and kwargs.get("position_bias") is None else 1
            o = _attend(module, g.scatter(query), (k, v), p.group_mask(i, fold), fold, **kwargs)  # [b, m, heads, D]
        outputs.append(o.reshape(-1, *o.shape[2:]))  # [b * m, heads, D]
    if len(p.groups) == 1 and p.groups[0].target is None:  # no pads: already the packed order
        return outputs[0][None], None
    out = query.new_zeros(query.shape[2], query.shape[1], query.shape[3])  # [T, heads, D]
    for g, o in zip(p.groups, outputs, strict=True):
        out[g.source] = o if g.target is None else o[g.target]
    return out[None], None


class _OneHeadPerKv:
    """The attention module as SDPA sees it once its query heads are folded onto their KV heads."""

    num_key_value_groups = 1

    def __init__(self, module: torch.nn.Module) -> None:
        self.is_causal = getattr(module, "is_causal", True)


def _attend(
    module: torch.nn.Module,
    query: torch.Tensor,  # [b, heads, m, D]
    kv: tuple[torch.Tensor, torch.Tensor],  # key, value: [b, kv_heads, C, D] each
    mask: torch.Tensor,  # [b, 1, groups * m, C]: each query's mask row, repeated per folded head
    groups: int,  # query heads per KV head to fold (1: no folding)
    **kwargs: Any,
) -> torch.Tensor:  # [b, m, heads, D]
    """SDPA with grouped-query heads folded into the query length, for any m.

    Transformers folds only single-token queries and otherwise repeats every key and value per
    query head (a copy of the rows' whole cache, heads/kv_heads times, per layer): the queries of
    one KV head's group become one longer query row set, [b, kv, g * m, D], each with its own mask row.
    """
    b, heads, m, dim = query.shape
    key, value = kv
    if groups == 1:
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)[0]
    folded = query.reshape(b, heads // groups, groups * m, dim)  # head kv * g + r, query i -> row r * m + i
    folded_module = cast(torch.nn.Module, _OneHeadPerKv(module))  # all SDPA reads of it: the two attributes
    out, _ = sdpa_attention_forward(folded_module, folded, key, value, mask, **kwargs)
    # [b, g * m, kv, D] -> [b, m, kv * g, D]
    return out.view(b, groups, m, heads // groups, dim).permute(0, 2, 3, 1, 4).reshape(b, m, heads, dim)


def row_offsets(lengths: list[int]) -> list[int]:
    """Each row's first position in the packed row: [0, l0, l0 + l1, ...]."""
    return [0, *itertools.accumulate(lengths)][:-1]


def _long(values: Any, device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.long, device=device)


def register() -> None:
    """`ATTENTION` as an attention implementation transformers' models take (`ModelRunner` calls this before it sets
    one). At the first run of a model, not at import: transformers' modeling module, which holds the registries,
    takes ~3 s to import, and the router and the front door import this engine but never run a model."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, packed_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # masks for calls that are not packed (e.g. generate)
