"""Per-group worker state: one cache owner per (router lane, micro-batch group), evicted when idle.

Workers keep a separate cache owner (a `TargetVerifier` or a drafter, each with its own
`ModelRunner` over the one shared model) per group key `"<router>/<lane>/<group>"`. A runner's
forward and commit act on all of its rows at once (`speculative/engine/runner.py`), so each ping-pong half
has a runner of its own and a verify or a draft of one half never carries the other half's rows.
(Forwards are packed, `speculative/engine/packing.py`: a row costs compute only for the tokens it adds.)
Keys also keep router replicas apart (caches keyed by router replica and sequence: docs/design.md,
"Pools, placement, scaling").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class GroupCaches(Generic[T]):
    def __init__(self, make: Callable[[], T], idle_evict_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._make = make
        self._idle_evict_s = idle_evict_s
        self._clock = clock
        self._owners: dict[str, T] = {}
        self._used: dict[str, float] = {}

    def get(self, key: str) -> T:
        if key not in self._owners:
            self._owners[key] = self._make()
        self._used[key] = self._clock()
        return self._owners[key]

    def peek(self, key: str) -> T | None:
        return self._owners.get(key)

    def drop(self, keys: list[str]) -> None:
        for key in keys:
            self._owners.pop(key, None)
            self._used.pop(key, None)

    def idle(self) -> list[str]:
        """Keys unused for longer than the eviction delay (the caller drops them)."""
        now = self._clock()
        return [k for k, t in self._used.items() if now - t > self._idle_evict_s]

    def owners(self) -> list[T]:
        """Every group's cache owner (for accounting: what the worker holds)."""
        return list(self._owners.values())

    def __len__(self) -> int:
        return len(self._owners)
