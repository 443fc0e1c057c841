"""How long a verify forward may run before its replica counts as hung: sized to its work by what this
replica measured, not a fixed constant.

A shard answers `ping` on a thread of its own, beside a running forward, so a forward that never returns
(a stuck collective, a kernel that spins, a deadlock) would leave the replica healthy and every stream of its
lanes waiting. The replica times each forward against `deadline_s`: its tokens at the measured seconds per
token, times `verify_deadline_factor`, never under `verify_deadline_min_s`. Past it, `check_health` fails, Serve
replaces the replica (its shards go with it), and the lanes' calls fail as a lost replica's and are retried on
the replacement, which re-prefills from the tokens they carry.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from actors.wire import WireVerifyItem

MEMORY = 0.8  # weight an old seconds-per-token measurement keeps at each new one


def forward_tokens(items: list[WireVerifyItem], chunk: int | None) -> int:
    """An upper bound on the tokens a verify forward computes: what the sequences may still prefill (at most
    a chunk), and each proposal's tokens plus its bonus."""
    prefill = sum(len(item.tokens) for item in items)
    drafted = sum(item.proposal.tree.size + 1 for item in items)
    return (prefill if chunk is None else min(prefill, chunk)) + drafted


@dataclass
class VerifyDeadline:
    """One replica's running forward against its deadline, and its measured seconds per token."""

    factor: float
    least_s: float
    per_token_s: float | None = None  # measured; None before the first forward
    running: tuple[float, float, int] | None = None  # (start, deadline s, tokens) of the forward in flight
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    def deadline_s(self, tokens: int) -> float:
        expected = 0.0 if self.per_token_s is None else self.per_token_s * max(tokens, 1)
        return max(self.least_s, self.factor * expected)

    def start(self, tokens: int) -> None:
        self.running = (self.clock(), self.deadline_s(tokens), tokens)

    def stop(self, seconds: float | None) -> None:
        """The forward ended; `seconds` its compute time (None: it failed, nothing measured)."""
        if self.running is not None and seconds is not None:
            rate = seconds / max(self.running[2], 1)
            self.per_token_s = rate if self.per_token_s is None else MEMORY * self.per_token_s + (1 - MEMORY) * rate
        self.running = None

    def overdue(self) -> str | None:
        """Why the forward in flight is hung (it ran past its deadline), or None."""
        if self.running is None:
            return None
        start, deadline, tokens = self.running
        ran = self.clock() - start
        if ran <= deadline:
            return None
        return f"a verify forward has run {ran:.1f} s, past its deadline of {deadline:.1f} s ({tokens} tokens)"
