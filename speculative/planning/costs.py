"""What a lane's rounds cost: verify and draft seconds learned online, and how far rounds deliver
what their plans expected.

`StepCosts.round_seconds` prices a round that drafts d_i tokens for sequence i (row i, `rows.DraftRow`):

    cost(d) = V(sum_i (1 + w * d_i)) + D(n, max_i d_i) + C * sum_{d_i > 0} c_i
              (max(V, D + C * ...) when the draft call overlaps the verify forward)

V(x): seconds of a verify forward over x tokens (a forward packs its rows, `packing`, so a drafted
token costs one token's compute whatever the batch); w: tree nodes drafted per unit of depth
(`nodes_per_depth`, 1 for chains); D(n, k): seconds of a k-deep draft round over the n sequences
the draft model drafts, the call to the draft pool included (prompt lookup's drafts cost nothing);
c_i: tokens the draft model catches up on before sequence i drafts (`catch_up`); C: seconds per
caught-up token (`draft_token`).

V and D are curves (`CostCurve`): decayed means per power-of-two bucket of size (tokens for V;
sequences for D, per unit of depth), interpolated between buckets. Neighbours closer than SPREAD
in size are averaged first: their slope is noise. Below the smallest size a curve follows its first
slope (never below proportional to size); above the largest, its last slope, flat from a single
point, so a size never tried is priced like the largest tried until its own measurement comes.
With points (8 tokens, 0.21 s) and (32, 0.39 s), a slope of 7.5 ms per token:

    V(16) = 0.21 + 0.0075 * 8  = 0.27 s
    V(64) = 0.39 + 0.0075 * 32 = 0.63 s
    V(4)  = max(0.21 - 0.0075 * 4, 0.21 * 4 / 8) = 0.18 s

A target that borrows the draft's cores for a verify no draft call runs beside (`target_pool.borrow_cores`, the
CPU default) verifies on fewer cores whenever a draft call does run beside it (a pre-draft, the other group's
draft): such crowded verifies are a curve of their own (`beside`), which prices an overlapped round that calls
the draft model, while `verify` prices the rest, plain rounds among them. Alike, a plain round on both cores can
beat speculation whose verifies run on one core beside the draft. Where the target never borrows, every verify is
on `verify`.

Two factors correct the model where it errs: `calibration` (drafted tokens committed over those
expected: the sequences whose drafts look best are partly the lucky ones) scales every drafted
token's gain, and `draft_calibration` (draft calls' seconds over their plans': a sequence drafting
now and then pays its catch-up again) scales D. V needs none: its curve is measured directly, and a
whole round's few-percent drift would swamp what a few drafting sequences add. Plain rounds move
both back toward 1, so a lane that stopped drafting tries again.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from speculative.planning.depth import DepthConfig, tally
from speculative.rules.tree import TokenTree

CATCH_UP_MEASURED = 8  # catch-up tokens in a draft call from which it prices catching up, not a round
SPREAD = 1.5  # cost-curve points closer in size than this factor are averaged (their slope is noise)

if TYPE_CHECKING:
    from speculative.planning.rows import DraftRow, RoundShape
    from speculative.planning.sequence import Sequence


@dataclass
class _Point:
    """A decayed mean of (x, seconds) observations in one bucket."""

    x: float
    seconds: float
    seen: int  # the curve's observation count when this bucket was last observed


def _bucket(x: float) -> int:
    return max(math.ceil(math.log2(max(x, 1.0))), 0)


@dataclass
class CostCurve:
    """seconds as a function of size, from observations bucketed by log2(size)."""

    memory: float
    points: dict[int, _Point] = field(default_factory=dict)
    clock: int = 0  # observations so far

    def observe(self, x: float, seconds: float) -> None:
        self.clock += 1
        p = self.points.get(_bucket(x))
        if p is None:
            self.points[_bucket(x)] = _Point(x, seconds, self.clock)
        else:
            p.x = self.memory * p.x + (1 - self.memory) * x
            p.seconds = self.memory * p.seconds + (1 - self.memory) * seconds
            p.seen = self.clock

    def _spread(self) -> list[tuple[float, float]]:
        """The points by size, neighbours closer than SPREAD x apart averaged into one. Two buckets' means
        can sit side by side (a plain round of 16 tokens, one of 17 with a token drafted), and their
        few-percent noise would price a drafted token at several times what it costs."""
        pts = sorted((p.x, p.seconds) for p in self.points.values())
        spread = [pts[0]]
        for x, seconds in pts[1:]:
            x0, s0 = spread[-1]
            spread[-1:] = [((x0 + x) / 2, (s0 + seconds) / 2)] if x < SPREAD * x0 else [(x0, s0), (x, seconds)]
        return spread

    def largest(self) -> float:
        """The largest size observed (its bucket's decayed mean); 0 before any observation."""
        return max((p.x for p in self.points.values()), default=0.0)

    def age(self, x: float) -> int | None:
        """Observations since a size like x was last observed; None if never."""
        p = self.points.get(_bucket(x))
        return None if p is None else self.clock - p.seen

    def __call__(self, x: float) -> float | None:
        if not self.points:
            return None
        pts = self._spread()
        if x <= pts[0][0]:  # below: along the first slope (a fixed cost plus a per-token one), not below
            (x0, s0), (x1, s1) = pts[0], pts[1] if len(pts) > 1 else pts[0]  # proportional to size
            slope = max(s1 - s0, 0.0) / (x1 - x0) if x1 > x0 else 0.0
            return max(s0 - slope * (x0 - x), s0 * x / x0)
        if x >= pts[-1][0]:  # beyond what was seen: the last slope (never negative), flat from one point
            (x0, s0), (x1, s1) = pts[-2] if len(pts) > 1 else pts[-1], pts[-1]
            slope = max(s1 - s0, 0.0) / (x1 - x0) if x1 > x0 else 0.0
            return s1 + slope * (x - x1)
        for (x0, s0), (x1, s1) in itertools.pairwise(pts):
            if x <= x1:
                return s0 + (s1 - s0) * (x - x0) / (x1 - x0) if x1 > x0 else s1
        return pts[-1][1]  # not reached


class Planned(NamedTuple):
    """A drafting round as planned: what the calibrations compare it with when it ends."""

    base: float  # expected tokens without the load-capped drafts (one per sequence, plus uncapped drafts)
    drafted: float  # expected tokens from them
    draft_seconds: float  # the draft call's predicted seconds, uncalibrated


@dataclass
class StepCosts:
    """A lane's measured verify and draft costs, and what its rounds delivered against their plans."""

    config: DepthConfig = field(default_factory=DepthConfig)  # the memories of these measurements
    verify: CostCurve = field(init=False)  # seconds of a verify forward, by tokens in it
    beside: CostCurve = field(init=False)  # the same for verifies crowded by a draft call beside them
    draft_step: CostCurve = field(init=False)  # seconds per unit of depth of a draft round, by sequences
    nodes_per_depth: float = 1.0  # tree nodes drafted per unit of depth (1 for chains)
    rounds: int = 0  # rounds settled
    calibration: float = 1.0  # drafted tokens committed over expected, drafting rounds (decayed)
    draft_calibration: float = 1.0  # draft calls' seconds over those predicted, drafting rounds (decayed)
    draft_token: float | None = None  # seconds per token the draft model catches up on (decayed mean)
    pooled_accepted: float = 0.0  # decayed draft tokens accepted, all sequences of the lane
    pooled_trials: float = 0.0  # decayed accept/reject decisions, all sequences of the lane
    pooled_by_match: dict[int, tuple[float, float]] = field(default_factory=dict)  # lookup: run class -> the pair
    ahead_offset: float = 0.0  # seconds a pre-draft's worker has beyond the verify's predicted ones (decayed mean)

    def __post_init__(self) -> None:
        self.verify = CostCurve(self.config.cost_memory)
        self.beside = CostCurve(self.config.cost_memory)
        self.draft_step = CostCurve(self.config.cost_memory)

    def observe_verify(
        self,
        seqs: Seq[Sequence],
        trees: Seq[TokenTree],
        seconds: float,
        accepted: Seq[int] = (),
        crowded: bool = False,
    ) -> None:
        """A verify forward over `seqs` with these draft trees took `seconds` (`crowded`: on fewer cores, a draft
        call beside it); `accepted`: draft tokens each sequence kept (pooled into the lane's acceptance, the prior
        of sequences that just came). A sequence that joined in this step carried its whole prompt: prefill
        rounds are measurements too, and under load the only ones at large sizes."""
        if crowded:
            self.beside.observe(verify_tokens(seqs, trees), seconds)
            self.verify.clock += 1  # `verify`'s points age by every verify: a plain round re-measures them
        else:
            self.verify.observe(verify_tokens(seqs, trees), seconds)
        for seq, tree, kept in zip(seqs, trees, accepted, strict=False):
            proposed = max(tree.depths)
            if not proposed:
                continue
            run = seq.stats.lookup_run  # lookup drafts apart, by the run class of the match they came from
            if not run:  # the tally of depth.Acceptance.update, over the lane's model drafts
                pooled = self.pooled_accepted, self.pooled_trials
                self.pooled_accepted, self.pooled_trials = tally(*pooled, self.config.pooled_memory, proposed, kept)
            else:
                pooled = self.pooled_by_match.get(run, (0.0, 0.0))
                self.pooled_by_match[run] = tally(*pooled, self.config.pooled_memory, proposed, kept)
                seq.stats.tally_lookup(run, proposed, kept, self.config.memory)

    def observe_round(self, predicted: Planned | None, tokens: int) -> None:
        """A round ended with `tokens` committed; `predicted`: its plan's `Plan.predicted` (None: plain,
        which moves both calibrations back toward 1)."""
        self.rounds += 1
        relax, memory = self.config.calibration_relax, self.config.calibration_memory
        if predicted is None:
            self.calibration += relax * (1.0 - self.calibration)
            self.draft_calibration += relax * (1.0 - self.draft_calibration)
        elif predicted.drafted > 0:
            ratio = min(max((tokens - predicted.base) / predicted.drafted, 0.0), 2.0)
            self.calibration = memory * self.calibration + (1 - memory) * ratio

    def ahead_deadline(self, predicted: float) -> float:
        """A pre-draft's seconds of drafting beside a verify predicted to take `predicted`: until its verdict
        reaches the router, the calls' hops and the prediction's bias included (`observe_ahead`)."""
        return max(predicted + self.ahead_offset, 0.0)

    def ahead_draft_seconds(self, depth: int) -> float:
        """A one-sequence pre-draft's predicted seconds at `depth` (its guess of the bonus one forward more),
        calibrated; 0 before a draft round is measured."""
        step = self.draft_step(1)
        return 0.0 if step is None or not depth else step * (depth + 1) * self.draft_calibration

    def observe_ahead(self, predicted: float, fitted: float) -> None:
        """A pre-draft beside a verify predicted to take `predicted` seconds could have drafted `fitted`
        seconds before the verdict reached the router (its own seconds, less how late it answered: a pre-draft
        that worked 0.33 s and answered 0.02 s after the verdict had 0.31 s)."""
        memory = self.config.cost_memory
        self.ahead_offset = memory * self.ahead_offset + (1 - memory) * (fitted - predicted)

    def acceptance_prior(self, default: float, run: int = 0) -> float:
        """The lane's recent acceptance, leaning on `default` (4 decisions' worth) while it has few, so
        first drafts that all missed do not stop drafting for good. With `run` (a `lookup.run_class`),
        that of lookup drafts from matches in that class only: chance matches land far less often than
        quotes."""
        pooled = self.pooled_accepted, self.pooled_trials
        accepted, trials = self.pooled_by_match.get(run, (0.0, 0.0)) if run else pooled
        return (accepted + 4.0 * default) / (trials + 4.0)

    def observe_draft(
        self, seqs: Seq[Sequence], trees: Seq[TokenTree], seconds: float, planned: Planned | None = None
    ) -> None:
        """A draft call that proposed `trees` for `seqs` took `seconds`; `planned`: the round's plan. Only
        the draft model's drafts are measured (prompt lookup's cost nothing). A call that caught up on
        CATCH_UP_MEASURED tokens or more measures catching up per token, beyond what a round of its size
        costs, not a round: as a round it would price later rounds out."""
        depths = [0 if s.stats.lookup_run else max(t.depths) for s, t in zip(seqs, trees, strict=True)]  # lookup: free
        drafting = [s for s, d in zip(seqs, depths, strict=True) if d]
        if not drafting:
            return
        if planned is not None and planned.draft_seconds > 0:
            ratio = min(max(seconds / planned.draft_seconds, 0.5), 4.0)
            memory = self.config.calibration_memory
            self.draft_calibration = memory * self.draft_calibration + (1 - memory) * ratio
        caught_up = sum(s.stats.draft_catch_up for s in drafting)
        if caught_up >= CATCH_UP_MEASURED:
            # Before any round is measured (a lane's first call catches up on every prompt) the whole
            # call is charged to catching up: an upper bound that later calls decay toward the truth.
            base = self.draft_step(len(drafting)) or 0.0
            if seconds > base * max(depths):
                per_token = (seconds - base * max(depths)) / caught_up
                old = self.draft_token
                memory = self.config.cost_memory
                self.draft_token = per_token if old is None else memory * old + (1 - memory) * per_token
            return
        self.draft_step.observe(len(drafting), seconds / max(depths))
        width = sum(t.size for t in trees) / sum(depths)  # nodes per unit of depth: 1 for chains
        memory = self.config.cost_memory
        self.nodes_per_depth = memory * self.nodes_per_depth + (1 - memory) * max(width, 1.0)

    def round_seconds(self, rows: Seq[DraftRow], depths: Seq[int], shape: RoundShape) -> float:
        """Predicted seconds of a round drafting `depths` ([n], one per row), each drafting row's `catch_up`
        charged (`free` rows: drafts by prompt lookup or heads; `shape.extra_levels`: draft forwards beyond
        the deepest depth; `shape.overlapped`: the draft call runs beside the verify, which it crowds)."""
        # lookup drafts chains; the draft model `nodes_per_depth` nodes per unit of depth
        nodes = (d if r.free else round(self.nodes_per_depth * d) for r, d in zip(rows, depths, strict=True))
        tokens = sum(1 + x for x in nodes)
        draft = self.draft_seconds(rows, depths, shape.extra_levels) * self.draft_calibration
        if shape.overlapped and draft > 0:
            return max(self.verify_beside(tokens) or 0.0, draft)
        return (self.verify(tokens) or 0.0) + draft

    def verify_beside(self, tokens: float) -> float | None:
        """Predicted seconds of a verify over `tokens` with a draft call beside it: `beside`'s where it measured
        such a size or a smaller one, else `verify`'s (a crowded prefill alone would price every small verify
        at its seconds: the first crowded drafting round measures them)."""
        if any(bucket <= _bucket(tokens) for bucket in self.beside.points):
            return self.beside(tokens)
        return self.verify(tokens)

    def draft_seconds(self, rows: Seq[DraftRow], depths: Seq[int], extra: int = 0) -> float:
        """The draft call's seconds by the curves (uncalibrated): a round over the rows the draft model
        drafts (not the `free` ones), `extra` forwards beyond the deepest depth."""
        modelled = [d if not r.free else 0 for r, d in zip(rows, depths, strict=True)]
        drafting = sum(1 for d in modelled if d)
        if not drafting:
            return 0.0
        draft = (self.draft_step(drafting) or 0.0) * (max(modelled) + extra)
        if self.draft_token:
            draft += self.draft_token * sum(r.catch_up for r, d in zip(rows, modelled, strict=True) if d)
        return draft


def verify_tokens(seqs: Seq[Sequence], trees: Seq[TokenTree]) -> int:
    """Tokens a verify forward over `seqs` with these trees computes: a tree's nodes and root, or the
    whole prompt of a sequence in its prefill round."""
    return sum(t.size + 1 if s.stats.steps else len(s.tokens) for s, t in zip(seqs, trees, strict=True))


def catch_up(seq: Sequence) -> int:
    """Tokens the draft model must catch up on before this sequence drafts, beyond a round's worth:
    none if it drafted last round, else every token since it last drafted (its prompt if never)."""
    if seq.stats.drafted_at == seq.stats.steps - 1:
        return 0
    return len(seq.tokens) - seq.stats.draft_synced
