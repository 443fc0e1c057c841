"""One KV pool per replica process: every runner's cache buffers, counted in bytes, within the KV budget.

A replica process (a target shard, a draft replica) runs one runner per lane group over its one model,
each with a cache of its own (`kv_cache.SlotCache`: per layer, keys and values [slots, capacity, kv_heads,
D]). Each cell, one slot's column, costs `token_bytes` over all layers (`kv_budget.kv_bytes_per_token`).
The runners draw on one pool: a cache's slots x columns are granted by the pool before its buffers are
made or grown at that shape, and go back to it when the cache is trimmed or its runner is dropped (the
pool holds its runners weakly: a runner gone holds nothing).

The pool holds the budget's tokens plus PADDING_SHARE of them (`pool_bytes`): a group's rows are padded to
its longest row, widths are rounded up to `kv_cache.BUCKET` columns, and a round's tree goes past a
sequence's last token, so the buffers of the sequences admission lets in (prompt + max_tokens each, within
the same token budget) hold more cells than their tokens. Worked example: SmolLM2-135M in float32 takes
46,080 bytes a token, so a budget of 1,024 tokens is a pool of 1,024 x 46,080 x 5/4 = 58,982,400 bytes.

How a cache grows (`KvPool.take`): to the first shape asked for that fits beside what the other runners
hold (at least double what it held, so growth is a rare copy; else exactly what the forward needs and its
rows use, `ModelRunner._room`); where none fits, every other runner is trimmed to the rows and columns it
uses (a runner whose sequences all left gives back everything, one that doubled gives back the unused
part), and if the forward still does not fit it fails with `KvPoolFull`, naming the pool, before anything
is allocated. Other groups' caches are never evicted to make room: they are live, and a group re-prefilled
on every round would never finish. Where a group's padding passes PADDING_SHARE (one long sequence among
short ones, the pool nearly full), its forward is the one that fails. A growth copies layer by layer, so one
layer's old buffers live beside the new ones for a moment.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Sequence
from fractions import Fraction
from typing import Protocol

from speculative.engine.kv_cache import Shape

PADDING_SHARE = Fraction(1, 4)  # cells the pool holds past its budget's tokens, as a share of them


class KvPoolFull(MemoryError):
    """A forward needs more KV memory than its process's pool has left, with every other runner trimmed."""


class Holder(Protocol):
    """A runner drawing on the pool: what its cache holds, and how it gives back what it does not use."""

    def kv_bytes(self) -> int:
        """Bytes of the cells its cache was granted."""
        ...

    def trim(self) -> None:
        """Shrink its cache to the rows and columns its sequences use now."""
        ...


def pool_bytes(tokens: int, token_bytes: int) -> int:
    """Bytes of the pool of a budget of `tokens`: their KV plus PADDING_SHARE for padding."""
    return int(tokens * token_bytes * (1 + PADDING_SHARE))


class KvPool:
    """The KV memory of one process's runners, within `capacity` bytes."""

    def __init__(self, tokens: int, token_bytes: int, knob: str) -> None:
        """`tokens`: the replica's KV budget; `token_bytes`: one cell's bytes over all layers; `knob`: the config
        key that sets the budget (for messages)."""
        self.tokens, self.token_bytes, self.knob = tokens, token_bytes, knob
        self.capacity = pool_bytes(tokens, token_bytes)
        self._holders: weakref.WeakSet[Holder] = weakref.WeakSet()

    def join(self, holder: Holder) -> None:
        self._holders.add(holder)

    def held(self) -> int:
        """Bytes every runner's cache holds together."""
        return sum(h.kv_bytes() for h in list(self._holders))

    def bytes_of(self, shape: Shape) -> int:
        return shape[0] * shape[1] * self.token_bytes

    def take(self, asking: Holder, shapes: Sequence[Shape]) -> Shape:
        """The first of `shapes` (most wanted first; the last is what `asking` cannot do without) that fits beside
        what the other runners hold, trimming them first where none does."""
        for shape in shapes:
            if self.bytes_of(shape) <= self._room(asking):
                return shape
        for holder in list(self._holders):
            if holder is not asking:
                holder.trim()
        needed = shapes[-1]
        if self.bytes_of(needed) > self._room(asking):
            gc.collect()  # a dropped runner in a reference cycle holds its buffers until collected
        if self.bytes_of(needed) <= self._room(asking):
            return needed
        raise KvPoolFull(
            f"KV pool full: a forward needs {self.bytes_of(needed):,} bytes of KV buffers ({needed[0]} rows x "
            f"{needed[1]} columns) and the other runners hold {self.held() - asking.kv_bytes():,} of the pool's "
            f"{self.capacity:,} ({self.knob} {self.tokens:,} tokens x {self.token_bytes:,} bytes, plus "
            f"{PADDING_SHARE} for padding rows to their group's longest)"
        )

    def _room(self, asking: Holder) -> int:
        """Bytes `asking` may hold in all: the pool less what the others hold."""
        return self.capacity - (self.held() - asking.kv_bytes())
