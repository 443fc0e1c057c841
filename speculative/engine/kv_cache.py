"""The runner's KV cache: per layer, keys and values in fixed slots, written in place by index.

Layout per layer: keys and values [slots, capacity, kv_heads, D]. Row b of the runner's batch is
slot b. Row b's committed tokens fill columns 0..lens[b]-1; its speculative tokens (appended since
the last commit) sit right after them, speculative column j at cache column lens[b] + j. A forward
writes each new token's key and value at its (row, column) with one `index_copy_` per layer (the
buffer seen as [slots * capacity, kv_heads, D]) and attends over the view [:rows, :width] as
[rows, kv_heads, width, D] (no copy, no concatenation). Commit moves the kept
speculative columns of a row to lens[b]..; a chain's accepted prefix is already there, so only a
tree's side branch moves. Rollback moves nothing: the runner's lengths stop short of the dropped
columns and the mask hides them. Columns past a row's tokens hold zeros or stale finite keys,
always masked.

Example, one row, lens 5, a tree verified as speculative columns 0..3 with parents (-1, 0, 0, 1):
the accepted path [0, 2] keeps column 5 in place and moves column 7 to 6; lens becomes 7.

Buffers are made at the first forward, from its keys (tensor-parallel shards hold fewer heads
than the config says), at the cache's rows and columns (`slots` x `capacity`), and are resized to the
shape the runner asks for (`resize`): at least double when a forward needs more (a rare copy, never a
per-step one, but a stall: fresh memory is paged in as it is written, ~10 ms for 16 MB on a CPU), or
exactly what it needs where a replica's KV pool has no room for double (`kv_pool`), and shrunk to what
the rows use when the pool reclaims. Replicas reserve up front (`preallocated`) where their pool has
room, so a long prompt joining a running batch does not grow them mid-stream.
Views are `BUCKET` columns wide multiples, so a decode's shapes change only every BUCKET tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

BUCKET = 32  # view widths are multiples of this many columns
Shape = tuple[int, int]  # (slots, columns) of the buffers
PREALLOCATED_ROWS = 8  # rows a replica's cache is made with
PREALLOCATED_TOKENS = 16_384  # most tokens (rows x columns) it is made with: 460 MB for Qwen2.5-1.5B in bf16


@dataclass(frozen=True)
class Write:
    """Where one forward's packed tokens go: token t to slot r, column c at index[t] = r * capacity + c."""

    index: torch.Tensor  # [T] int64 on the model's device
    batch: int  # rows attended over (slots 0..batch-1)
    width: int  # columns attended over (0..width-1), a BUCKET multiple


class SlotCache(DynamicCache):
    """Static-layout keys and values; the runner sets `write` for the duration of each forward.

    A DynamicCache subclass only so that models accept it as their cache; none of its storage is used.
    """

    def __init__(self, config: Any) -> None:
        super().__init__(config=config)
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [slots, capacity, kv_heads, D]
        self.values: dict[int, torch.Tensor] = {}
        self.slots = 0  # rows every buffer holds at least
        self.capacity = 0  # columns every buffer holds at least
        self.write: Write | None = None

    def reserve(self, rows: int, cols: int) -> None:
        """Make room for `rows` rows of `cols` columns: at least double when growing."""
        if not self.holds(rows, cols):  # every forward asks: nothing to walk
            self.resize(*self.doubled(rows, cols))

    def holds(self, rows: int, cols: int) -> bool:
        return rows <= self.slots and cols <= self.capacity

    def doubled(self, rows: int, cols: int) -> Shape:
        """The shape growing to `rows` x `cols` takes: each dimension that grows, at least doubled."""
        slots = max(rows, 2 * self.slots) if rows > self.slots else self.slots
        capacity = bucketed(max(cols, 2 * self.capacity)) if cols > self.capacity else self.capacity
        return slots, capacity

    def cells(self) -> int:
        """(slot, column) cells the buffers hold (made at the first forward): what a KV pool counts."""
        return self.slots * self.capacity

    def resize(self, rows: int, cols: int) -> None:
        """Buffers of exactly `rows` slots of `cols` columns (a BUCKET multiple), keeping what fits of the old
        (a shrink keeps the first rows and columns: callers shrink only past what their rows use)."""
        self.slots, self.capacity = rows, cols
        for store in (self.keys, self.values):
            if rows * cols == 0:
                store.clear()  # made again at the next forward
            for layer, buf in store.items():
                store[layer] = self._resized(buf)

    def _resized(self, buf: torch.Tensor) -> torch.Tensor:  # [slots, capacity, kv, D]
        if tuple(buf.shape[:2]) == (self.slots, self.capacity):
            return buf
        new = buf.new_zeros(self.slots, self.capacity, *buf.shape[2:])
        rows, cols = min(self.slots, buf.shape[0]), min(self.capacity, buf.shape[1])
        new[:rows, :cols] = buf[:rows, :cols]
        return new

    def index(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:  # [T] each -> [T]
        """`Write.index` of tokens at these slots and columns (valid until the next growth)."""
        return rows * self.capacity + cols

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [batch, kv_heads, width, D] each, views of the buffers
        """Store a packed forward's keys and values [1, kv_heads, T, D] and return the rows' whole cache."""
        w = self.write
        if w is None:
            raise RuntimeError("SlotCache.update outside a runner forward")
        out = []
        for store, states in ((self.keys, key_states), (self.values, value_states)):
            buf = store.get(layer_idx)
            if buf is None:
                kv_heads, dim = states.shape[1], states.shape[3]
                buf = states.new_zeros(self.slots, self.capacity, kv_heads, dim)
                store[layer_idx] = buf
            flat = buf.view(-1, *buf.shape[2:])  # [slots * capacity, kv_heads, D]
            flat.index_copy_(0, w.index, states[0].transpose(0, 1))  # [T, kv_heads, D]
            out.append(buf[: w.batch, : w.width].transpose(1, 2))
        return out[0], out[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.write.width if self.write is not None else 0

    def move_columns(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Column src[i] of slot rows[i] to column dst[i] (all [M] int64, on the model's device)."""
        for store in (self.keys, self.values):
            for buf in store.values():
                buf[rows, dst] = buf[rows, src]

    def move_row(self, src: int, dst: int, cols: int) -> None:
        """Slot src's first `cols` columns to slot dst."""
        for store in (self.keys, self.values):
            for buf in store.values():
                buf[dst, :cols] = buf[src, :cols]

    def nbytes(self) -> int:
        """Bytes the buffers hold."""
        return sum(b.numel() * b.element_size() for s in (self.keys, self.values) for b in s.values())


def preallocated(budget_tokens: int, window: int) -> Shape:
    """(rows, columns) each runner of a replica asks for at start, granted where its KV pool has room
    (`kv_pool.KvPool.take`): PREALLOCATED_ROWS rows, each as long as the window, the KV budget or
    PREALLOCATED_TOKENS / PREALLOCATED_ROWS allow, whichever is least."""
    cols = min(window, budget_tokens, PREALLOCATED_TOKENS // PREALLOCATED_ROWS)
    return PREALLOCATED_ROWS, bucketed(max(cols, 1))


def bucketed(cols: int) -> int:
    """`cols` rounded up to a multiple of BUCKET."""
    return -(-cols // BUCKET) * BUCKET
