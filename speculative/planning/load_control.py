"""Speculation depth by load: per-sequence draft depths that maximise a batch's committed tokens/s.

`plan_depths` chooses, for each row (`rows.DraftRow`, one per sequence), d_i <= min(want_i, cap_i)
(a quote's cap: `max_quote_depth`), want_i the sequence's room (its own depth, `depth.own_depth`, where
the round is not priced or its tokens depend on depth), maximising the round's goodput

    goodput(d) = sum_i E(a_i, d_i) / cost(d)

E = `depth.expected_tokens`, a_i the row's acceptance estimate, cost = `costs.StepCosts.round_seconds`.
Drafted tokens count at 1/`min_gain` of their expected number (1/`lookup_min_gain` for lookup drafts
from chance matches, runs under QUOTE_RUN; the row's `margin`): a margin on the drafted part alone, so
one sequence quoting its prompt among 16 need not speed up all 16 to draft.

One level deeper in sequence i gains a_i^(d_i+1) expected tokens, so the best m draft tokens are the
m largest gains and only m is searched. With a = 0.9 and 0.5, each wanting 2, the gains are 0.9,
0.81 and 0.5, 0.25: m = 3 drafts [2, 1]. m = 0 is plain decoding, chosen whenever speculation does
not pay: under heavy load throughput falls back to that without speculation, while a sequence
quoting its prompt (prompt lookup: free to draft) keeps drafting.

Every choice is weighed against the plain round, so the verify cost at the batch's size must have
been measured within `refresh_rounds` rounds; otherwise the round is plain and measures it. Before
any measurement every sequence drafts min(want, cap). A sequence's first round is its prefill alone.

Depths never change the committed tokens under greedy decoding or deterministic drafts. Under
rejection sampling (sampled drafts) they change which tokens are committed, not their distribution:
such rows are not load-capped (`DraftRow.capped` False), so a seeded request gives the same tokens at
any load and on replay after a failure.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import NamedTuple

from speculative.planning.costs import Planned, StepCosts
from speculative.planning.depth import expected_tokens
from speculative.planning.rows import QUOTE_RUN, DraftRow, RoundShape

__all__ = ["QUOTE_RUN", "DraftRow", "Plan", "RoundShape", "RowPlan", "choose_depths", "plan_depths"]


class RowPlan(NamedTuple):
    """One sequence's drafting as planned."""

    depth: int  # draft tokens
    run: int  # the prompt-lookup match's run class the draft is for (0: the draft model drafts)
    catch_up: int  # tokens the draft model catches up on before it drafts


@dataclass(frozen=True)
class Plan:
    """A round's drafting as planned. Planning changes nothing: the round records it (`Speculation.plan`)."""

    rows: list[RowPlan]  # one per sequence, in the rows' order
    predicted: Planned | None  # the round's prediction for the calibrations (None: not a priced round)

    @property
    def depths(self) -> list[int]:
        """[n] draft tokens per sequence."""
        return [r.depth for r in self.rows]


def plan_depths(rows: Seq[DraftRow], shape: RoundShape, costs: StepCosts | None) -> Plan:
    """The round's plan: each row's depth within min(want, cap), priced by `costs` where the round is
    priced (None: each drafts its limit). A draft model's row that drafts nothing gives way to its
    `fallback`, a short lookup match, and the round is priced again. A round carrying a prompt (a row in its
    prefill) is not a sample of drafting: it predicts nothing."""
    if costs is None:
        return Plan([RowPlan(r.limit, r.run, r.model_catch_up) for r in rows], None)
    depths, predicted = choose_depths(rows, costs, shape)
    fallen = [r.fallback if r.fallback is not None and not d else r for r, d in zip(rows, depths, strict=True)]
    if any(f is not r for f, r in zip(fallen, rows, strict=True)):  # where the model drafts nothing, its lookup
        rows = fallen  # match may: the round priced again with those rows
        depths, predicted = choose_depths(rows, costs, shape)
    if any(r.prefill for r in rows):
        predicted = None
    return Plan([RowPlan(d, r.run, r.model_catch_up) for r, d in zip(rows, depths, strict=True)], predicted)


def choose_depths(rows: Seq[DraftRow], costs: StepCosts, shape: RoundShape) -> tuple[list[int], Planned | None]:
    """Per-row depths within min(want, cap) with the most expected tokens per second (the allocation
    above), and the round's prediction (None: not priced, as unmeasured or plain rounds).

    A sequence at depth 0 gathers no evidence, so an estimate that fell in an unpredictable stretch
    (a preamble before quoted code) would hold it there: a row due a probe drafts one token where that
    makes the round at most `probe_cost` longer, its catch-up paid in full, and drafts as good as
    `probe_hope` would pay at this load (else what a probe finds could change nothing).
    """
    config, n = costs.config, len(rows)
    depths = [0 if r.capped else r.limit for r in rows]  # the uncapped
    if not any(r.capped and r.limit for r in rows):
        return depths, None
    modelled = any(r.limit and not r.free for r in rows)
    measured = costs.verify.points or costs.beside.points
    if not measured or (modelled and costs.draft_step(n) is None):  # unmeasured: draft as deep as
        return [r.limit for r in rows], None  # allowed once (no prediction: the round does not calibrate)
    age = costs.verify.age(n)
    if age is None or age > config.refresh_rounds:  # what not drafting costs at this size is unknown or old:
        return depths, None  # a plain round measures it (the alternative every choice is weighed against)
    priced = _Round(costs, list(rows), shape)
    chosen, plain, drafted = _best_depths(priced)
    predicted = None  # what the calibrations compare the round with: expected tokens (undiscounted), draft seconds
    if drafted:
        predicted = Planned(plain, drafted, priced.draft_seconds(chosen))
    _add_probes(chosen, priced)
    return chosen, predicted


@dataclass(frozen=True)
class _Round:
    """What prices a measured round's depths: the costs, the rows and the round's shape."""

    costs: StepCosts
    rows: list[DraftRow]
    shape: RoundShape

    def seconds(self, depths: list[int]) -> float:
        """Predicted seconds of the round drafting `depths` ([n], one per row)."""
        return self.costs.round_seconds(self.rows, depths, self.shape)

    def rate(self, tokens: float, depths: list[int]) -> float:
        """Expected committed tokens per second of the round drafting `depths`."""
        return tokens / max(self.seconds(depths), 1e-9)

    def draft_seconds(self, depths: list[int]) -> float:
        return self.costs.draft_seconds(self.rows, depths, self.shape.extra_levels)

    def probing(self) -> _Round:
        """The round with every row due a probe charged its whole catch-up (a probe pays it now)."""
        full = [replace(r, catch_up=r.probe) if r.probe is not None else r for r in self.rows]
        return replace(self, rows=full)

    def hoping(self, due: set[int], hope: float) -> _Round:
        """The round with the rows in `due` at an acceptance of at least `hope`."""
        hoped = [replace(r, acceptance=max(r.acceptance, hope)) if i in due else r for i, r in enumerate(self.rows)]
        return replace(self, rows=hoped)


def _add_probes(chosen: list[int], priced: _Round) -> None:
    """One draft token in `chosen` for each row due a probe that passes `choose_depths`'s test, best
    estimate first."""
    rows = priced.rows
    due = [i for i, r in enumerate(rows) if r.probe is not None and r.capped and r.limit and not chosen[i]]
    if due:  # a probe is worth its cost only if drafts as good as `probe_hope` would pay at this load
        would, _, _ = _best_depths(priced.hoping(set(due), priced.costs.config.probe_hope))
        due = [i for i in due if would[i]]  # (else whatever it finds, the sequence stays at 0)
    if due:
        probing = priced.probing()
        limit = probing.seconds(chosen) * (1 + priced.costs.config.probe_cost)
        for i in sorted(due, key=lambda i: -rows[i].acceptance):
            chosen[i] = 1
            if probing.seconds(chosen) > limit:
                chosen[i] = 0


def _best_depths(priced: _Round) -> tuple[list[int], float, float]:
    """The depths with the most expected tokens per second (costs measured), the expected tokens of
    the round without the load-capped drafts, and those the chosen drafts add (undiscounted). A drafted
    token counts at its expected number over its row's margin: the gains are taken in that order."""
    rows = priced.rows
    base = [0 if r.capped else r.limit for r in rows]  # the uncapped
    depths = list(base)
    gains = sorted(  # (counted, expected, row) per drafted token
        (
            (r.acceptance**j / r.margin, r.acceptance**j, i)
            for i, r in enumerate(rows)
            if r.capped
            for j in range(1, r.limit + 1)
        ),
        key=lambda g: -g[0],
    )
    plain = sum(expected_tokens(r.acceptance, d) for r, d in zip(rows, base, strict=True))
    best_m, best_rate, drafted = 0, priced.rate(plain, depths), 0.0
    for m, (counted, _, i) in enumerate(gains, start=1):
        depths[i] += 1
        drafted += counted
        rate = priced.rate(plain + drafted * priced.costs.calibration, depths)
        if rate > best_rate * (1 + 1e-6):
            best_m, best_rate = m, rate
    chosen = list(base)
    for _, _, i in gains[:best_m]:
        chosen[i] += 1
    return chosen, plain, sum(expected for _, expected, _ in gains[:best_m])
