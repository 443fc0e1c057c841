"""Speculation depth by load: the per-batch cap on draft tokens that maximises committed tokens/s.

Per sequence, `adaptive.AdaptiveDepth` picks how deep to draft from acceptance alone. Per batch,
the right depth also depends on what a verify forward costs at that size: on a CPU a forward of 8
tokens costs about one decode step but one of 64 costs twice that (MODELS.md); on a GPU it is flat
until the batch turns compute-bound. So a lane measures its own calls and, before each draft, caps
every sequence's depth at the k that maximises the batch's goodput

    goodput(k) = sum_i E(a_i, d_i(k)) / cost(k),    d_i(k) = min(want_i, k)
    cost(k)    = V(sum_i (1 + w * d_i(k))) + D(n, max_i d_i(k))    (max(V, D) when overlapped)

where E is `adaptive.expected_tokens`, a_i a sequence's acceptance estimate, want_i its own
depth, w the tree nodes drafted per unit of depth (1 for chains), V(x) the measured seconds of a
verify forward over x tokens and D(n, k) of a k-deep draft round over n sequences. k = 0 is plain
decoding (no draft call): chosen whenever the measurements say speculation does not pay, so under
heavy load throughput with speculation on falls back to that with it off.

V and D are learned online: decayed means per power-of-two bucket of tokens (verify) or of batch
size (draft, per unit of depth), interpolated between buckets, extrapolated linearly above the
largest one seen (pessimistic) and flat below the smallest. Before any measurement the cap is
left as it was.

Depths change which tokens are drafted, never which are committed under greedy decoding or under
target-sample matching (deterministic drafts: the committed token at each position is the keyed
target sample). Under rejection sampling (sampled drafts) they change which tokens are committed,
though not their distribution; such sequences are left uncapped (`capped`), so a seeded request
gives the same tokens at any load and when replayed after a failure.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from speculative.adaptive import expected_tokens

if TYPE_CHECKING:
    from speculative.decoder import Sequence


@dataclass
class _Point:
    """A decayed mean of (x, seconds) observations in one bucket."""

    x: float
    seconds: float


@dataclass
class _Curve:
    """seconds as a function of size, from observations bucketed by log2(size)."""

    memory: float
    points: dict[int, _Point] = field(default_factory=dict)

    def observe(self, x: float, seconds: float) -> None:
        bucket = max(math.ceil(math.log2(max(x, 1.0))), 0)
        p = self.points.get(bucket)
        if p is None:
            self.points[bucket] = _Point(x, seconds)
        else:
            p.x = self.memory * p.x + (1 - self.memory) * x
            p.seconds = self.memory * p.seconds + (1 - self.memory) * seconds

    def __call__(self, x: float) -> float | None:
        if not self.points:
            return None
        pts = sorted((p.x, p.seconds) for p in self.points.values())
        if x <= pts[0][0]:
            return pts[0][1]
        if x >= pts[-1][0]:
            return pts[-1][1] * x / pts[-1][0]
        for (x0, s0), (x1, s1) in itertools.pairwise(pts):
            if x <= x1:
                return s0 + (s1 - s0) * (x - x0) / (x1 - x0) if x1 > x0 else s1
        return pts[-1][1]  # not reached


@dataclass
class StepCosts:
    """A lane's measured verify and draft costs."""

    memory: float = 0.7  # weight an old observation keeps at each new one in its bucket
    verify: _Curve = field(init=False)  # seconds of a verify forward, by tokens in it
    draft_step: _Curve = field(init=False)  # seconds per unit of depth of a draft round, by sequences
    nodes_per_depth: float = 1.0  # tree nodes drafted per unit of depth (1 for chains)

    def __post_init__(self) -> None:
        self.verify = _Curve(self.memory)
        self.draft_step = _Curve(self.memory)

    def observe_verify(self, tokens: int, seconds: float) -> None:
        """A verify call whose forward carried `tokens` new tokens (roots + tree nodes) took `seconds`."""
        self.verify.observe(tokens, seconds)

    def observe_draft(self, sequences: int, depth: int, nodes: int, seconds: float) -> None:
        """A draft call over `sequences`, at most `depth` deep, `nodes` nodes in all, took `seconds`."""
        if depth <= 0:
            return
        self.draft_step.observe(sequences, seconds / depth)
        drafted_depth = max(nodes, 1) / max(sequences, 1) / depth
        self.nodes_per_depth = self.memory * self.nodes_per_depth + (1 - self.memory) * max(drafted_depth, 1.0)


def choose_cap(
    wants: list[int],  # [n] each sequence's own depth (acceptance, room left)
    acceptances: list[float],  # [n] each sequence's acceptance estimate
    costs: StepCosts,
    max_cap: int,
    overlapped: bool = False,
    capped: list[bool] | None = None,  # [n] False: the sequence drafts `want` whatever the cap (it costs all the same)
) -> int:
    """The depth cap in 0..max_cap with the most expected tokens per second; max_cap until measured."""
    n = len(wants)
    capped = capped or [True] * n
    if not any(capped) or max_cap <= 0:
        return max(max_cap, 0)
    if not costs.verify.points:
        return max_cap
    best, best_rate = 0, -1.0
    for k in range(max_cap + 1):
        depths = [min(w, k) if c else w for w, c in zip(wants, capped, strict=True)]
        deepest = max(depths)
        verify = costs.verify(n + costs.nodes_per_depth * sum(depths))
        step = costs.draft_step(n) if deepest else 0.0
        if verify is None or step is None:  # never drafted yet: try the full depth once to learn D
            return max_cap
        draft = step * deepest
        seconds = max(verify, draft) if overlapped else verify + draft
        tokens = sum(expected_tokens(a, d) for a, d in zip(acceptances, depths, strict=True))
        rate = tokens / max(seconds, 1e-9)
        if rate > best_rate * (1 + 1e-6):
            best, best_rate = k, rate
        if max(w for w, c in zip(wants, capped, strict=True) if c) <= k:  # larger k changes nothing
            break
    return best


def plan_depths(
    seqs: Seq[Sequence], costs: StepCosts | None, cap: int, overlapped: bool = False, drafts_sampled: bool = True
) -> list[int]:
    """Each sequence's draft depth this round: its own (acceptance, room left) within `cap`, and with
    `costs` within the load cap too, except for sequences whose tokens depend on depth (sampled drafts)."""
    # A step always adds one token, so a sequence drafts at most max_tokens - len(output) - 1.
    wants = [max(min(s.depth.next_depth(), s.params.max_tokens - len(s.output) - 1), 0) for s in seqs]
    if costs is None:
        return [min(w, cap) for w in wants]
    capped = [s.params.greedy or not drafts_sampled for s in seqs]
    load_cap = choose_cap(wants, [s.depth.acceptance for s in seqs], costs, cap, overlapped, capped)
    return [min(w, load_cap if c else cap) for w, c in zip(wants, capped, strict=True)]
