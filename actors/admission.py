"""Admission by KV memory: the window a deployment can serve, and each target replica's reservations.

Every sequence reserves its whole KV footprint, prompt plus max_tokens, when it is admitted, and
returns it when it leaves the replica (finished, cancelled, failed: the lane's release of it). So a
replica never holds more than its `kv_budget_tokens` of sequences, and a sequence admitted never
runs out of room half-way. Worked example, budget 1,024: sequences of 300 + 200 and 100 + 100
hold 700; a request of 200 + 200 must wait (HTTP 429 with Retry-After), one of 1,000 + 100 can
never fit (HTTP 400 naming the limit: it is over the window).

The target replica keeps the ledger, not the router: several router replicas share the target
replicas, and only the replica sees all their sequences. Entries of sequences no call has named for
`idle_s` are dropped (a router that died never releases them), as their caches are.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from actors.wire import Reserved


@dataclass(frozen=True)
class ContextWindow:
    """Most prompt + generated tokens of one sequence, and what sets it (named for the message)."""

    tokens: int
    limit: str  # e.g. "the KV budget of a target replica, target_pool.kv_budget_tokens"

    @staticmethod
    def smallest(*windows: ContextWindow | None) -> ContextWindow:
        return min((w for w in windows if w is not None), key=lambda w: w.tokens)


class KvLedger:
    """KV tokens reserved per sequence on one replica, within its budget; `changed(held, budget)` hears of every
    change (the replica's KV usage metric)."""

    def __init__(
        self, budget: int, idle_s: float, replica: str, changed: Callable[[int, int], None] = lambda held, budget: None
    ) -> None:
        self.budget, self.idle_s, self.replica, self._changed = budget, idle_s, replica, changed
        self._held: dict[str, int] = {}  # sequence id -> reserved tokens
        self._seen: dict[str, float] = {}  # sequence id -> last call naming it (monotonic)

    @property
    def held(self) -> int:
        return sum(self._held.values())

    def __len__(self) -> int:
        return len(self._held)

    def reserve(self, seq_id: str, tokens: int) -> Reserved:
        """Reserve `tokens` for a new sequence if they fit in what is left of the budget."""
        self._expire()
        granted = seq_id in self._held or self.held + tokens <= self.budget
        if granted:
            self._take(seq_id, tokens)
            self._changed(self.held, self.budget)
        return Reserved(granted, self.held, self.budget, self.replica)

    def running(self, reservations: dict[str, int]) -> None:
        """Sequences a verify call carries: fresh, and taken over where this replica lacks their reservation
        (granted elsewhere: they run already, so they are counted even past the budget)."""
        for seq_id, tokens in reservations.items():
            if seq_id in self._held or tokens:
                self._take(seq_id, self._held.get(seq_id, tokens))
        self._changed(self.held, self.budget)

    def release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self._held.pop(seq_id, None)
            self._seen.pop(seq_id, None)
        if seq_ids:
            self._changed(self.held, self.budget)

    def _take(self, seq_id: str, tokens: int) -> None:
        self._held[seq_id] = tokens
        self._seen[seq_id] = time.monotonic()

    def _expire(self) -> None:
        now = time.monotonic()
        self.release([s for s, t in self._seen.items() if now - t > self.idle_s])
