"""Speculation depth by load: per-sequence draft depths that maximise a batch's committed tokens/s.

`plan_depths` chooses d_i <= min(want_i, cap) (a quote's cap: `max_quote_depth`), want_i the
sequence's room (its own depth, `depth.own_depth`, where the round is not priced or its tokens
depend on depth), maximising the round's goodput

    goodput(d) = sum_i E(a_i, d_i) / cost(d)

E = `depth.expected_tokens`, a_i the acceptance estimate, cost = `costs.StepCosts.round_seconds`.
Drafted tokens count at 1/`min_gain` of their expected number (1/`lookup_min_gain` for lookup drafts
from chance matches, runs under QUOTE_RUN): a margin on the drafted part alone, so one sequence
quoting its prompt among 16 need not speed up all 16 to draft.

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
such sequences are not load-capped (`capped` False), so a seeded request gives the same tokens at
any load and on replay after a failure.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from speculative.drafters.lookup import PromptLookupDrafter, run_prior
from speculative.planning.costs import Planned, StepCosts, catch_up
from speculative.planning.depth import DepthConfig, expected_tokens, own_depth

QUOTE_RUN = 8  # prompt lookup: a match whose run (`lookup.run_class`) is this long is text being quoted

if TYPE_CHECKING:
    from speculative.planning.sequence import Sequence


def choose_depths(
    wants: list[int],  # [n] each sequence's own depth (acceptance, room left)
    acceptances: list[float],  # [n] each sequence's acceptance estimate
    costs: StepCosts,
    cap: int,
    overlapped: bool = False,
    capped: list[bool] | None = None,  # [n] False: the sequence drafts min(want, cap) whatever the load
    catch_ups: list[float] | None = None,  # [n] catch-up tokens charged to this round if it drafts
    probes: dict[int, float] | None = None,  # sequences due a probe -> tokens their draft must catch up on
    min_gains: list[float] | None = None,  # [n] the margin on each sequence's drafted tokens; None: min_gain
    free: list[bool] | None = None,  # [n] True: drafts by prompt lookup (no draft call to pay for)
    extra_levels: int = 0,  # draft forwards beyond the depth (a pre-draft also drafts its guess of the bonus)
) -> tuple[list[int], Planned | None]:
    """Per-sequence depths within min(want, cap) with the most expected tokens per second (the
    allocation above), and the round's prediction (None: not priced, as unmeasured or plain rounds).

    A sequence at depth 0 gathers no evidence, so an estimate that fell in an unpredictable stretch
    (a preamble before quoted code) would hold it there: a sequence due a probe drafts one token where
    that makes the round at most `probe_cost` longer, its catch-up paid in full, and drafts as good as
    `probe_hope` would pay at this load (else what a probe finds could change nothing).
    """
    config = costs.config
    n = len(wants)
    capped = capped or [True] * n
    depths = [min(w, cap) if not c else 0 for w, c in zip(wants, capped, strict=True)]  # the uncapped
    if not any(c and min(w, cap) for w, c in zip(wants, capped, strict=True)):
        return depths, None
    free = free or [False] * n
    modelled = any(min(w, cap) and not f for w, f in zip(wants, free, strict=True))
    if not costs.verify.points or (modelled and costs.draft_step(n) is None):  # unmeasured: draft as deep as
        return [min(w, cap) for w in wants], None  # allowed once (no prediction: the round does not calibrate)
    age = costs.verify.age(n)
    if age is None or age > config.refresh_rounds:  # what not drafting costs at this size is unknown or old:
        return depths, None  # a plain round measures it (the alternative every choice is weighed against)
    catch, margins = catch_ups or [0] * n, min_gains or [config.min_gain] * n
    priced = _Round(costs, cap, overlapped, capped, catch, margins, free, extra_levels)
    chosen, plain, drafted = _best_depths(wants, acceptances, priced)
    predicted = None  # what the calibrations compare the round with: expected tokens (undiscounted), draft seconds
    if drafted:
        predicted = Planned(plain, drafted, priced.draft_seconds(chosen))
    _add_probes(chosen, wants, acceptances, probes or {}, priced)
    return chosen, predicted


@dataclass(frozen=True)
class _Round:
    """What prices a measured round's depths: the costs and, per sequence, what its drafting entails."""

    costs: StepCosts
    cap: int
    overlapped: bool  # the draft call runs beside the verify forward
    capped: list[bool]  # [n] False: drafts min(want, cap) whatever the load
    catch: list[float]  # [n] catch-up tokens charged to this round if the sequence drafts
    margins: list[float]  # [n] the margin on each sequence's drafted tokens
    free: list[bool]  # [n] drafts by prompt lookup (no draft call to pay for)
    extra: int  # draft forwards beyond the depth

    def seconds(self, depths: list[int], catch: list[float] | None = None) -> float:
        """Predicted seconds of the round drafting `depths` (`catch`: other catch-up charges)."""
        catch = self.catch if catch is None else catch
        return self.costs.round_seconds(depths, self.overlapped, catch, self.free, self.extra)

    def rate(self, tokens: float, depths: list[int]) -> float:
        """Expected committed tokens per second of the round drafting `depths`."""
        return tokens / max(self.seconds(depths), 1e-9)

    def draft_seconds(self, depths: list[int]) -> float:
        return self.costs.draft_seconds(depths, self.catch, self.free, self.extra)


def _add_probes(
    chosen: list[int], wants: list[int], acceptances: list[float], probes: dict[int, float], priced: _Round
) -> None:
    """One draft token in `chosen` for each sequence due a probe (`probes`: index -> its catch-up) that
    passes `choose_depths`'s test, best estimate first."""
    config = priced.costs.config
    due = [i for i in probes if priced.capped[i] and min(wants[i], priced.cap) and not chosen[i]]
    if due:  # a probe is worth its cost only if drafts as good as `probe_hope` would pay at this load
        hope = set(due)
        hoped = [max(a, config.probe_hope) if i in hope else a for i, a in enumerate(acceptances)]
        would, _, _ = _best_depths(wants, hoped, priced)
        due = [i for i in due if would[i]]  # (else whatever it finds, the sequence stays at 0)
    if due:
        full = [probes.get(i, c) for i, c in enumerate(priced.catch)]  # a probe pays its catch-up now
        limit = priced.seconds(chosen, full) * (1 + config.probe_cost)
        for i in sorted(due, key=lambda i: -acceptances[i]):
            chosen[i] = 1
            if priced.seconds(chosen, full) > limit:
                chosen[i] = 0


def _best_depths(wants: list[int], acceptances: list[float], priced: _Round) -> tuple[list[int], float, float]:
    """The depths with the most expected tokens per second (costs measured), the expected tokens of
    the round without the load-capped drafts, and those the chosen drafts add (undiscounted). A drafted
    token counts at its expected number over its sequence's margin: the gains are taken in that order."""
    cap, capped = priced.cap, priced.capped
    base = [min(w, cap) if not c else 0 for w, c in zip(wants, capped, strict=True)]  # the uncapped
    depths = list(base)
    gains = sorted(  # (counted, expected, sequence) per drafted token
        (
            (a**j / g, a**j, i)
            for i, (w, a, c, g) in enumerate(zip(wants, acceptances, capped, priced.margins, strict=True))
            if c
            for j in range(1, min(w, cap) + 1)
        ),
        key=lambda g: -g[0],
    )
    plain = sum(expected_tokens(a, d) for a, d in zip(acceptances, base, strict=True))
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


class Plan(NamedTuple):
    """A round's drafting as planned. Planning changes nothing: the round records it (`record_plan`)."""

    depths: list[int]  # [n] draft tokens per sequence
    runs: list[int]  # [n] the prompt-lookup match's run class each draft is for (0: the draft model drafts)
    catch_ups: list[int]  # [n] tokens the draft model catches up on before each drafts
    predicted: Planned | None  # the round's prediction for the calibrations (None: not a priced round)


def plan_depths(
    seqs: Seq[Sequence],
    config: DepthConfig,
    costs: StepCosts | None,
    cap: int,
    overlapped: bool = False,
    drafts_sampled: bool = True,
    lookup: PromptLookupDrafter | None = None,
    lookup_quotes: bool = False,
    extra_levels: int = 0,
    free_drafts: bool = False,
    quote_cap: int | None = None,
) -> Plan:
    """The round's plan: each sequence's depth within its room and `cap`, priced by `costs` where
    `config.load_adaptive` (not sequences whose tokens depend on depth: sampled drafts).

    `lookup`: prompt lookup drafts in the router, and each depth knows its sequence's match (no
    match: no draft). With `lookup_quotes` the lookup sits beside a draft model and drafts only
    quotes (runs of QUOTE_RUN or more; greedy or deterministic drafts), free and as deep as the quote
    goes, so they still pay under load where the draft model does not; the draft model drafts the rest.
    `extra_levels`: draft forwards beyond the depth (a pre-draft drafts its guess of the bonus first).
    `free_drafts`: every draft costs nothing to make (Medusa heads' guesses, computed inside the verify).
    `quote_cap`: the cap of a quote (a lookup draft from a run of QUOTE_RUN or more; `cap` where None).
    """
    priced = costs if config.load_adaptive else None
    # A step always adds one token, so a sequence drafts at most max_tokens - len(output) - 1.
    # A request may cap its own depth (`max_draft_tokens`; 0: no speculation for it).
    room = [max(min(s.params.max_tokens - len(s.output) - 1, _own_cap(s)), 0) for s in seqs]
    capped = [s.params.greedy or not drafts_sampled for s in seqs]
    wants = _own_wants(seqs, room, capped, config, priced is not None)
    quote_cap = cap if quote_cap is None else quote_cap
    matches = _lookup_matches(seqs, room, wants, capped, cap, quote_cap, lookup, lookup_quotes)
    runs = [n for n, _ in matches]
    caps = [quote_cap if n >= QUOTE_RUN else cap for n in runs]
    wants = [min(found if n else min(w, found), c) for w, (n, found), c in zip(wants, matches, caps, strict=True)]
    cap = max(caps, default=cap)  # each want is within its own cap now
    free = [bool(n) or free_drafts for n in runs]  # lookup, heads: no draft forward, nothing to catch up on
    catch_ups = [0 if f else catch_up(s) for s, f in zip(seqs, free, strict=True)]  # lookup keeps no cache
    if priced is None:
        return Plan([min(w, cap) for w in wants], runs, catch_ups, None)
    acceptances = _acceptances(seqs, runs, priced, config)
    charged = _charged_catch_ups(seqs, catch_ups, acceptances, wants)
    probes = _due_probes(seqs, catch_ups, priced, config)
    # Lookup's estimates from short runs are the least sure (chance matches), so their drafted tokens
    # must come at `lookup_min_gain` of plain decoding's price; drafts from runs of QUOTE_RUN tokens or
    # more are quotes and get the common margin, so a sequence quoting its prompt drafts under load.
    margins = [config.lookup_min_gain if run and run < QUOTE_RUN else config.min_gain for run in runs]
    depths, predicted = choose_depths(
        wants, acceptances, priced, cap, overlapped, capped, charged, probes, margins, free, extra_levels
    )
    if any(s.stats.steps == 0 for s in seqs):  # a prompt rides in this verify: not a sample of drafting
        predicted = None
    return Plan(depths, runs, catch_ups, predicted)


def _own_wants(
    seqs: Seq[Sequence], room: list[int], capped: list[bool], config: DepthConfig, priced: bool
) -> list[int]:
    """How deep each sequence may draft, within its room. Unpriced, and for sequences whose tokens depend
    on depth (not `capped`), that is its depth by its own evidence (`own_depth`, a fixed cost model).
    Priced, a capped sequence may draft its whole room: the measured costs and its acceptance choose
    the depth (`choose_depths`), so a draft hidden behind the verify goes as deep as it pays, not as
    deep as an unhidden one would. It drafts from its second round: drafting in its prefill round
    would have the draft model prefill the prompt before the target starts, delaying the first token
    and everyone's round in the batch."""
    return [
        (r if s.stats.steps else 0)
        if priced and c
        else min(own_depth(s.acceptance, s.stats.steps - s.stats.drafted_at, config), r)
        for s, r, c in zip(seqs, room, capped, strict=True)
    ]


def _lookup_matches(
    seqs: Seq[Sequence],
    room: list[int],
    wants: list[int],
    capped: list[bool],
    cap: int,
    quote_cap: int,
    lookup: PromptLookupDrafter | None,
    lookup_quotes: bool,
) -> list[tuple[int, int]]:
    """Per sequence (the match's run class, tokens the lookup would draft), or (0, want) for the draft
    model. Beside one (`lookup_quotes`), capped sequences past their prefill look for a quote as deep
    as their room allows, and a match shorter than QUOTE_RUN is left to the draft model. A quote drafts
    up to `quote_cap` tokens, any other match up to `cap`."""
    if lookup_quotes and lookup:
        looked = [min(r, quote_cap) if c and s.stats.steps else 0 for s, r, c in zip(seqs, room, capped, strict=True)]
        found = [lookup.match(s.tokens, n) if n else (0, 0) for s, n in zip(seqs, looked, strict=True)]
        return [(n, f) if n >= QUOTE_RUN and f else (0, w) for (n, f), w in zip(found, wants, strict=True)]
    if lookup is None:
        return [(0, w) for w in wants]
    # a drafting sequence looks as deep as a quote may go; a shorter match drafts within its want
    deepest = [min(r, max(cap, quote_cap)) if w else 0 for r, w in zip(room, wants, strict=True)]
    found = [lookup.match(s.tokens, n) if n else (0, 0) for s, n in zip(seqs, deepest, strict=True)]
    return [(n, f if n >= QUOTE_RUN else min(f, w, cap)) for (n, f), w in zip(found, wants, strict=True)]


def _charged_catch_ups(
    seqs: Seq[Sequence], catch_ups: list[int], acceptances: list[float], wants: list[int]
) -> list[float]:
    """Each sequence's catch-up spread over the rounds it has left at its own depth: it is paid once."""
    rounds_left = [
        max((s.params.max_tokens - len(s.output)) / expected_tokens(a, max(w, 1)), 1.0)
        for s, a, w in zip(seqs, acceptances, wants, strict=True)
    ]
    return [c / r for c, r in zip(catch_ups, rounds_left, strict=True)]


def _due_probes(seqs: Seq[Sequence], catch_ups: list[int], costs: StepCosts, config: DepthConfig) -> dict[int, float]:
    """Every probe_every-th round, the sequences that have not drafted for as long: index -> catch-up."""
    if costs.rounds % config.probe_every != config.probe_every - 1:
        return {}
    held = (i for i, s in enumerate(seqs) if s.stats.steps - s.stats.drafted_at > config.probe_every)
    return {i: float(catch_ups[i]) for i in held}


def _acceptances(seqs: Seq[Sequence], runs: list[int], costs: StepCosts, config: DepthConfig) -> list[float]:
    """Each sequence's acceptance estimate for its drafter. A new sequence leans on the lane's recent
    acceptance, so a workload the draft guesses badly does not draft on every arrival; a lookup match
    leans on the lane's drafts from its run class, and before there are any on `run_prior`, so a class
    that never drafted is not held at a prior too low to draft at."""
    return [
        _match_acceptance(s, run, costs.acceptance_prior(run_prior(run), run))
        if run
        else s.acceptance.estimate(costs.acceptance_prior(config.prior_acceptance))
        for s, run in zip(seqs, runs, strict=True)
    ]


def record_plan(seqs: Seq[Sequence], plan: Plan, lookup_quotes: bool) -> None:
    """The round drafts as planned: which drafter each sequence's verdict is tallied by, and what the draft
    model has seen of those it drafts (what `catch_up` counts from; a quote beside it: nothing)."""
    for s, d, run, c in zip(seqs, plan.depths, plan.runs, plan.catch_ups, strict=True):
        s.stats.lookup_run = run
        if d and not (run and lookup_quotes):
            s.stats.draft_synced, s.stats.drafted_at, s.stats.draft_catch_up = len(s.tokens), s.stats.steps, c


def _match_acceptance(seq: Sequence, run: int, prior: float) -> float:
    """A lookup draft's acceptance from this sequence's drafts off matches in run class `run`, leaning on
    the lane's (`prior`, 4 decisions' worth)."""
    accepted, trials = seq.stats.lookup_tally.get(run, (0.0, 0.0))
    return min(max((accepted + 4.0 * prior) / (trials + 4.0), 1e-3), 0.999)


def _own_cap(seq: Sequence) -> int:
    """The request's `max_draft_tokens`; without one, no cap beyond the server's."""
    own = seq.params.max_draft_tokens
    return own if own is not None else seq.params.max_tokens
