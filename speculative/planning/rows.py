"""The planner's rows: one `DraftRow` per sequence, what the load planner (`load_control.plan_depths`) weighs.

A row says how deep its sequence may draft (`want`, within `cap`), what a drafted token of it is worth
(its drafter's `acceptance`, discounted by `margin`) and what drafting it costs beyond its tokens
(`catch_up` for the draft model, nothing where it is `free`). `draft_rows` reads them off the sequences
and the lane's drafters; the shape every row of the round shares is a `RoundShape`.

A sequence's `want` is its room (max_tokens - len(output) - 1, within the request's `max_draft_tokens`);
where the round is not priced, or its tokens depend on depth (sampled drafts: not `capped`), its own depth
by acceptance (`depth.own_depth`) within that room. Prompt lookup then bounds it by its match: a match
of QUOTE_RUN or more agreeing tokens is a quote, drafted up to `quote_cap`, any other up to `cap`.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from speculative.drafters.lookup import PromptLookupDrafter, run_prior
from speculative.planning.costs import StepCosts, catch_up
from speculative.planning.depth import DepthConfig, depth_cap, expected_tokens, own_depth

QUOTE_RUN = 8  # prompt lookup: a match whose run (`lookup.run_class`) is this long is text being quoted

if TYPE_CHECKING:
    from speculative.planning.sequence import Sequence


@dataclass(frozen=True)
class DraftRow:
    """One sequence as the planner weighs it: how deep it may draft, what its drafts are worth and cost."""

    want: int  # draft tokens it may take: its room, its own depth, or its lookup match's tokens
    cap: int  # the most draft tokens any draft of it may take (`quote_cap` for a quote)
    acceptance: float  # its drafter's per-token acceptance estimate (0 where the round is not priced)
    margin: float  # its drafted tokens count at 1/margin of their expected number (`min_gain`, ...)
    capped: bool = True  # False: drafts min(want, cap) whatever the load (its tokens depend on depth)
    catch_up: float = 0.0  # catch-up tokens charged to this round if it drafts (its catch-up spread over its rounds)
    probe: float | None = None  # due a probe: the catch-up a probe pays in full now; None: not due
    free: bool = False  # drafts by prompt lookup or the target's heads: no draft forward to pay for
    run: int = 0  # the lookup match's run class it drafts from (0: the draft model drafts it)
    model_catch_up: int = 0  # tokens the draft model catches up on before it drafts (recorded with the plan)
    prefill: bool = False  # its first round: its prompt rides in this verify
    fallback: DraftRow | None = None  # the draft model's row: a short lookup match drafting where it would not

    @property
    def limit(self) -> int:
        """The deepest it may draft this round: min(want, cap)."""
        return min(self.want, self.cap)


@dataclass(frozen=True)
class RoundShape:
    """What every row of one round shares: its caps, and how its draft call runs."""

    cap: int  # the batch's depth cap (`depth.depth_cap`: the batch's size and the target's queue)
    quote_cap: int  # the cap of a quote (`max_quote_depth` within the batch's budget)
    overlapped: bool = False  # the draft call runs beside a verify forward
    extra_levels: int = 0  # draft forwards beyond the depth (a pre-draft drafts its guess of the bonus first)

    @classmethod
    def of(
        cls, config: DepthConfig, batch: int, queued: int = 0, overlapped: bool = False, extra_levels: int = 0
    ) -> RoundShape:
        """The shape of a micro-batch of `batch` with `queued` verify calls waiting at the target."""
        cap, quote_cap = depth_cap(config, batch, queued), depth_cap(config, batch, queued, quote=True)
        return cls(cap, quote_cap, overlapped, extra_levels)


class Drafters(Protocol):
    """Who drafts a lane's sequences, as the rows need to know (`round.Speculation` holds it)."""

    config: DepthConfig
    drafts_sampled: bool  # the drafter samples under sampling: such sequences' depths ignore load
    lookup: PromptLookupDrafter | None  # prompt lookup drafted here: the drafter, or quotes beside a model
    lookup_quotes: bool  # `lookup` sits beside a draft model and drafts only quoting sequences
    free_drafts: bool  # every draft costs nothing to make (Medusa heads' guesses, made inside the verify)


def draft_rows(seqs: Seq[Sequence], shape: RoundShape, drafters: Drafters, costs: StepCosts | None) -> list[DraftRow]:
    """One row per sequence, in order; `costs`: the measured costs where the round is priced (else None)."""
    return [_row(s, shape, drafters, costs) for s in seqs]


def _row(seq: Sequence, shape: RoundShape, drafters: Drafters, costs: StepCosts | None) -> DraftRow:
    """The sequence's row. Lookup and heads drafts are free: no draft forward, nothing to catch up on. Beside
    a draft model, a match shorter than a quote drafts by lookup where its run class lands at least as often
    as the model does for the sequence; else the model's row holds it as its `fallback`."""
    room = max(min(seq.params.max_tokens - len(seq.output) - 1, _own_cap(seq)), 0)
    capped = _capped(seq, drafters)
    want = _own_want(seq, room, capped, drafters.config, costs is not None)
    run, found, short = _lookup_match(seq, room, want, capped, shape, drafters)
    row = _made(seq, run, found, shape, drafters, costs)
    if short is None or costs is None:
        return row
    looked = _made(seq, *short, shape, drafters, costs)
    return looked if looked.acceptance >= row.acceptance else replace(row, fallback=looked)


def _made(
    seq: Sequence, run: int, tokens: int, shape: RoundShape, drafters: Drafters, costs: StepCosts | None
) -> DraftRow:
    """The row drafting up to `tokens` by a lookup match of run class `run` (0: by the draft model)."""
    config = drafters.config
    capped = _capped(seq, drafters)
    cap = shape.quote_cap if run >= QUOTE_RUN else shape.cap
    want = min(tokens, cap)
    free = bool(run) or drafters.free_drafts
    owed = 0 if free else catch_up(seq)  # lookup keeps no cache
    prefill = seq.stats.steps == 0
    if costs is None:
        return DraftRow(
            want, cap, 0.0, config.min_gain, capped, free=free, run=run, model_catch_up=owed, prefill=prefill
        )
    acceptance = _acceptance(seq, run, costs, config)
    # Lookup's estimates from short runs are the least sure (chance matches), so their drafted tokens
    # must come at `lookup_min_gain` of plain decoding's price; drafts from runs of QUOTE_RUN tokens or
    # more are quotes and get the common margin, so a sequence quoting its prompt drafts under load.
    margin = config.lookup_min_gain if run and run < QUOTE_RUN else config.min_gain
    # A catch-up is paid once: spread over the rounds the sequence has left at its own depth.
    rounds_left = max((seq.params.max_tokens - len(seq.output)) / expected_tokens(acceptance, max(want, 1)), 1.0)
    probe = float(owed) if _due_probe(seq, costs, config) else None
    return DraftRow(want, cap, acceptance, margin, capped, owed / rounds_left, probe, free, run, owed, prefill)


def _capped(seq: Sequence, drafters: Drafters) -> bool:
    """Whether the sequence's drafted tokens leave its output unchanged, so load may cap its depth: greedy, or
    drafts that are not sampled."""
    return seq.params.greedy or not drafters.drafts_sampled


def _own_want(seq: Sequence, room: int, capped: bool, config: DepthConfig, priced: bool) -> int:
    """How deep the sequence may draft, within its room. Unpriced, and for a sequence whose tokens depend
    on depth (not `capped`), that is its depth by its own evidence (`own_depth`, a fixed cost model).
    Priced, a capped sequence may draft its whole room: the measured costs and its acceptance choose
    the depth (`load_control.choose_depths`), so a draft hidden behind the verify goes as deep as it
    pays, not as deep as an unhidden one would. It drafts from its second round: drafting in its prefill
    round would have the draft model prefill the prompt before the target starts, delaying the first
    token and everyone's round in the batch."""
    if priced and capped:
        return room if seq.stats.steps else 0
    return min(own_depth(seq.acceptance, seq.stats.steps - seq.stats.drafted_at, config), room)


def _lookup_match(
    seq: Sequence, room: int, want: int, capped: bool, shape: RoundShape, drafters: Drafters
) -> tuple[int, int, tuple[int, int] | None]:
    """(the match's run class, tokens the lookup would draft), or (0, want) for the draft model; and beside
    one (`lookup_quotes`), a match shorter than QUOTE_RUN as (run class, tokens), else None. There a capped
    sequence past its prefill looks for a quote as deep as its room allows. A quote drafts up to `quote_cap`
    tokens, any other match up to `cap`."""
    lookup = drafters.lookup
    if drafters.lookup_quotes and lookup:
        looked = min(room, shape.quote_cap) if capped and seq.stats.steps else 0
        run, found = lookup.match(seq.tokens, looked, seq.params.prediction, len(seq.prompt)) if looked else (0, 0)
        if run >= QUOTE_RUN and found:
            return run, found, None
        return 0, want, (run, found) if run and found else None
    if lookup is None:
        return 0, want, None
    # a drafting sequence looks as deep as a quote may go; a shorter match drafts within its want
    deepest = min(room, max(shape.cap, shape.quote_cap)) if want else 0
    run, found = lookup.match(seq.tokens, deepest, seq.params.prediction, len(seq.prompt)) if deepest else (0, 0)
    return run, found if run >= QUOTE_RUN else min(found, want, shape.cap), None


def _due_probe(seq: Sequence, costs: StepCosts, config: DepthConfig) -> bool:
    """Every probe_every-th round, a sequence that has not drafted for as long is due a probe."""
    if costs.rounds % config.probe_every != config.probe_every - 1:
        return False
    return seq.stats.steps - seq.stats.drafted_at > config.probe_every


def _acceptance(seq: Sequence, run: int, costs: StepCosts, config: DepthConfig) -> float:
    """The sequence's acceptance estimate for its drafter. A new sequence leans on the lane's recent
    acceptance, so a workload the draft guesses badly does not draft on every arrival; a lookup match
    leans on the lane's drafts from its run class, and before there are any on `run_prior`, so a class
    that never drafted is not held at a prior too low to draft at."""
    if not run:
        return seq.acceptance.estimate(costs.acceptance_prior(config.prior_acceptance))
    prior = costs.acceptance_prior(run_prior(run), run)
    accepted, trials = seq.stats.lookup_tally.get(run, (0.0, 0.0))  # its own, leaning on the lane's (4 decisions)
    return min(max((accepted + 4.0 * prior) / (trials + 4.0), 1e-3), 0.999)


def _own_cap(seq: Sequence) -> int:
    """The request's `max_draft_tokens`; without one, no cap beyond the server's."""
    own = seq.params.max_draft_tokens
    return own if own is not None else seq.params.max_tokens
