"""Speculation depth by load: per-sequence draft depths that maximise a batch's committed tokens/s.

Per sequence, `depth.own_depth` picks how deep to draft from acceptance alone. Per batch,
the right depths also depend on what a verify forward costs at that size: on a CPU a forward of 8
tokens costs about one decode step but one of 64 costs twice that (docs/models.md); on a GPU it is flat
until the batch turns compute-bound. So a lane measures its own calls and, before each draft,
chooses depths d_i <= min(want_i, cap) maximising the round's goodput

    goodput(d) = sum_i E(a_i, d_i) / cost(d)
    cost(d)    = V(P(1 + w * d_1, ..., 1 + w * d_n)) + D(n, max_i d_i) + C * sum_{d_i > 0} c_i
                 (max(V, D + C...) when overlapped)

where E is `depth.expected_tokens`, a_i a sequence's acceptance estimate, w the tree nodes
drafted per unit of depth (1 for chains), P the tokens the runner computes for rows of those
lengths (their sum: a forward packs its rows, `packing`, so a drafted token costs one token's
compute whatever the batch, not a row's worth of padding), V(x) the measured seconds of a verify
forward over x tokens, D(n, k) of a k-deep draft round over n sequences as the round waits for it
(the call to the draft pool included), c_i the tokens the draft model must catch up on before
sequence i drafts (its prompt if it never drafted, every token since if it stopped: `catch_up`),
spread over the rounds the sequence has left (it is paid once), and C the measured seconds per
caught-up token. Drafted tokens are counted at 1/`min_gain` (1.1; 2 for prompt lookup's drafts
from chance matches, whose estimates are the least sure, unlike quotes': `QUOTE_RUN`) of their
expected number: what drafting adds must come at least 10 % cheaper per token than plain decoding's
tokens, a margin on the drafted part alone. (A margin on the whole round's rate would ask a sequence
quoting its prompt among 16 to speed up all 16 by 10 %.) Prompt lookup's drafts (the drafter, or
beside a draft model the quotes: `plan_depths`) are found in the router and cost nothing to draft:
D and C count the draft model's sequences alone, and a lookup draft costs only its verify tokens.

Going one level deeper in sequence i gains a_i^(d_i+1) tokens, so the best allocation of m draft
tokens takes the m largest gains and only m is searched. All zero is plain decoding (no draft
call): chosen whenever the measurements say speculation does not pay, so under heavy load
throughput with speculation on falls back to that with it off, while a sequence that quotes its
prompt keeps drafting when the others stop.

V and D are learned online: decayed means per power-of-two bucket of tokens (verify) or of batch
size (draft, per unit of depth), interpolated between buckets (neighbours less than 1.5x apart in
size averaged first: their slope would be noise), below the smallest along the first
slope (never below proportional to size), and above the largest along the last slope (flat from a
single point: a size never tried is assumed to cost what the largest tried did, so it gets tried
once and then priced by its own measurement). Before any measurement every sequence drafts
min(want, cap). A sequence's first round is its prefill alone (no draft, so speculation never delays
a first token); under sampled drafts, where depth must not depend on load, it drafts from the first.
Every choice is weighed against the plain round, so its cost V(n) must be measured, not guessed: a
lane that has always drafted has seen only larger forwards, and a plain round priced like them makes
drafting look better than it is. When V(n) at the current size was never measured, or not in the
last `refresh_rounds` verifies, the round is plain (capped sequences draft nothing).

What the model leaves out on the token side (acceptance estimates that run high: the sequences
whose drafts look best are partly the lucky ones) is learned as one factor: the drafted tokens a
round committed over those it was expected to, applied to every drafted token's expected gain (a
winner's curse discount). On the time side, the verify forward is left to its measured curve: a
round's seconds drift by several percent on a shared machine, which on the whole round's rate would
swamp what a few sequences drafting add. The draft call, timed on its own, is compared with its plan
as a second factor on D: catching up, charged spread over the rounds a sequence has left, is paid
again by a sequence that drafts now and then. Plain rounds move both back toward 1, so a lane that
stopped drafting tries again now and then.

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
from typing import TYPE_CHECKING, NamedTuple

from speculative.depth import DepthConfig, expected_tokens, own_depth, tally
from speculative.drafters.lookup import PromptLookupDrafter, run_prior
from speculative.tree import TokenTree

CATCH_UP_MEASURED = 8  # catch-up tokens in a draft call from which it prices catching up, not a round
QUOTE_RUN = 8  # prompt lookup: a match whose run (`lookup.run_class`) is this long is text being quoted
SPREAD = 1.5  # cost-curve points closer in size than this factor are averaged (their slope is noise)

if TYPE_CHECKING:
    from speculative.sequence import Sequence


@dataclass
class _Point:
    """A decayed mean of (x, seconds) observations in one bucket."""

    x: float
    seconds: float
    seen: int  # the curve's observation count when this bucket was last observed


def _bucket(x: float) -> int:
    return max(math.ceil(math.log2(max(x, 1.0))), 0)


@dataclass
class _Curve:
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
        """The points by size, neighbours closer than SPREAD x apart averaged into one: a slope is only as
        good as the sizes it spans. Two buckets' means can sit side by side (16 and 17 tokens: a plain
        round of 16 and one with a token drafted), and their few-percent noise would then price a
        drafted token at several times what it costs (seen: 33 ms for 1 token, 8.5 ms measured)."""
        pts = sorted((p.x, p.seconds) for p in self.points.values())
        spread = [pts[0]]
        for x, seconds in pts[1:]:
            x0, s0 = spread[-1]
            spread[-1:] = [((x0 + x) / 2, (s0 + seconds) / 2)] if x < SPREAD * x0 else [(x0, s0), (x, seconds)]
        return spread

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
    verify: _Curve = field(init=False)  # seconds of a verify forward, by tokens in it
    draft_step: _Curve = field(init=False)  # seconds per unit of depth of a draft round, by sequences
    nodes_per_depth: float = 1.0  # tree nodes drafted per unit of depth (1 for chains)
    rounds: int = 0  # rounds settled
    calibration: float = 1.0  # drafted tokens committed over expected, drafting rounds (decayed)
    draft_calibration: float = 1.0  # draft calls' seconds over those predicted, drafting rounds (decayed)
    draft_token: float | None = None  # seconds per token the draft model catches up on (decayed mean)
    pooled_accepted: float = 0.0  # decayed draft tokens accepted, all sequences of the lane
    pooled_trials: float = 0.0  # decayed accept/reject decisions, all sequences of the lane
    pooled_by_match: dict[int, tuple[float, float]] = field(default_factory=dict)  # lookup: run class -> the pair

    def __post_init__(self) -> None:
        self.verify = _Curve(self.config.cost_memory)
        self.draft_step = _Curve(self.config.cost_memory)

    def observe_verify(
        self, seqs: Seq[Sequence], trees: Seq[TokenTree], seconds: float, accepted: Seq[int] = ()
    ) -> None:
        """A verify forward over `seqs` with these draft trees took `seconds`; `accepted`: draft tokens
        each sequence kept (pooled into the lane's acceptance, the prior of sequences that just came).

        It carried each tree's root and nodes, and a sequence's whole prompt when it joined in this
        step (prefill rides in the same forward): prefill rounds are measurements too, and under
        load with requests arriving they are most rounds, and the only ones at large sizes.
        """
        lengths = [t.size + 1 if s.stats.steps else len(s.tokens) for s, t in zip(seqs, trees, strict=True)]
        self.verify.observe(sum(lengths), seconds)
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
                own = seq.stats.lookup_tally.get(run, (0.0, 0.0))
                seq.stats.lookup_tally[run] = tally(*own, self.config.memory, proposed, kept)

    def observe_round(self, predicted: Planned | None, tokens: int) -> None:
        """A round ended with `tokens` committed; `predicted`: its plan's `Plan.predicted`.

        Drafting rounds calibrate the drafted tokens' expected number against what they delivered;
        plain rounds let both calibrations drift back toward 1, so drafting is tried again later.
        """
        self.rounds += 1
        relax, memory = self.config.calibration_relax, self.config.calibration_memory
        if predicted is None:
            self.calibration += relax * (1.0 - self.calibration)
            self.draft_calibration += relax * (1.0 - self.draft_calibration)
        elif predicted.drafted > 0:
            ratio = min(max((tokens - predicted.base) / predicted.drafted, 0.0), 2.0)
            self.calibration = memory * self.calibration + (1 - memory) * ratio

    def acceptance_prior(self, default: float, run: int = 0) -> float:
        """The lane's recent acceptance, leaning on `default` (4 decisions' worth) while it has few:
        a lane whose first drafts all missed must not conclude that none will ever land. With `run`
        (prompt lookup: a `lookup.run_class`), that of drafts from matches in that class only: on the
        load sweep's mix, drafts from runs of 1-4 tokens were right 30 % of the time, from 8 or more
        every time."""
        pooled = self.pooled_accepted, self.pooled_trials
        accepted, trials = self.pooled_by_match.get(run, (0.0, 0.0)) if run else pooled
        return (accepted + 4.0 * default) / (trials + 4.0)

    def observe_draft(
        self, seqs: Seq[Sequence], trees: Seq[TokenTree], seconds: float, planned: Planned | None = None
    ) -> None:
        """A draft call that proposed `trees` for `seqs` took `seconds`; `planned`: the round's plan. Only
        the draft model's drafts are measured: prompt lookup's cost nothing (`plan_depths` prices them so).

        A call in which the draft model caught up on many tokens (a new sequence's prompt, or one that
        has not drafted for a while: `catch_up`) measures the cost of catching up per token, beyond
        what a round of that size costs, not the cost of a round: it would price later rounds out.
        Against the plan, calls calibrate the draft side as a whole: catching up is charged spread over
        the rounds a sequence has left, which holds while it keeps drafting; one that drafts now and
        then pays it again each time it resumes, and those calls take longer than planned.
        """
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
            # Before any round is measured (a lane's first draft call catches up on every prompt), the
            # whole call is charged to catching up: an upper bound, decayed toward the truth by later
            # calls. Left unpriced, catching up would cost nothing in every plan until a measured
            # round came first, and a probe round for 16 held sequences (1,100 tokens to catch up,
            # 1.5 s) was planned at 83 ms.
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


def catch_up(seq: Sequence) -> int:
    """Tokens the draft model must catch up on before this sequence drafts, beyond a round's worth:
    none if it drafted last round, else every token since it last drafted (its prompt if never)."""
    if seq.stats.drafted_at == seq.stats.steps - 1:
        return 0
    return len(seq.tokens) - seq.stats.draft_synced


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
    """Per-sequence depths within min(want, cap) with the most expected tokens per second, and the
    round's prediction (None where the round is not priced: unmeasured, plain, or only uncapped drafts).

    Drafting one level deeper in sequence i adds a_i^(d+1) expected tokens (the chance that every
    token down to it is accepted) and `nodes_per_depth` tokens to the verify forward, so the best
    allocation of m draft tokens takes the m largest such gains; m is chosen by the measured costs.
    Before the costs are measured every sequence gets min(want, cap).

    A sequence kept at depth 0 gathers no evidence, so an estimate that fell while the text was
    unpredictable (a preamble before the quoted code) would hold it there for good: sequences due a
    probe draft one token if, catch-up paid in full, that makes the round at most `probe_cost`
    longer, and only where drafts as good as `probe_hope` would pay at this load: where not even
    they would (a draft model under heavy load), what a probe finds could change nothing. Probes
    come in rounds of their own (`plan_depths`), so under load they share one forward and one draft
    call instead of taxing every round.
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
        return _seconds(depths, self.costs, self.overlapped, catch, self.free, self.extra)

    def rate(self, tokens: float, depths: list[int]) -> float:
        """Expected committed tokens per second of the round drafting `depths`."""
        return tokens / max(self.seconds(depths), 1e-9)

    def draft_seconds(self, depths: list[int]) -> float:
        return _draft_seconds(depths, self.costs, self.catch, self.free, self.extra)


def _add_probes(
    chosen: list[int], wants: list[int], acceptances: list[float], probes: dict[int, float], priced: _Round
) -> None:
    """Give sequences due a probe (`probes`: index -> its full catch-up) one draft token in `chosen`,
    best estimate first, while the round stays within `probe_cost` of its length, catch-ups paid in full."""
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


def _seconds(
    depths: list[int], costs: StepCosts, overlapped: bool, catch: list[float], free: list[bool], extra: int = 0
) -> float:
    """Predicted seconds of a round drafting `depths`, `catch` tokens of catch-up per drafting sequence."""
    nodes = (d if f else round(costs.nodes_per_depth * d) for d, f in zip(depths, free, strict=True))  # lookup: chains
    verify = costs.verify(sum(1 + x for x in nodes)) or 0.0
    draft = _draft_seconds(depths, costs, catch, free, extra) * costs.draft_calibration
    return max(verify, draft) if overlapped else verify + draft


def _draft_seconds(depths: list[int], costs: StepCosts, catch: list[float], free: list[bool], extra: int = 0) -> float:
    """The draft call's seconds by the curves (uncalibrated): a round over the sequences the draft model
    drafts (not those drafting by lookup: `free`), `extra` forwards beyond the deepest depth."""
    modelled = [d if not f else 0 for d, f in zip(depths, free, strict=True)]
    drafting = sum(1 for d in modelled if d)
    if not drafting:
        return 0.0
    draft = (costs.draft_step(drafting) or 0.0) * (max(modelled) + extra)
    if costs.draft_token:
        draft += costs.draft_token * sum(c for c, d in zip(catch, modelled, strict=True) if d)
    return draft


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
) -> Plan:
    """Each sequence's draft depth this round: its own (acceptance, room left) within `cap`, and with
    `costs` (and `config.load_adaptive`) within the load cap too, except for sequences whose tokens
    depend on depth (sampled drafts).

    With `lookup` (the drafter is prompt lookup, whose drafts cost nothing to find), depths are weighed
    knowing each sequence's match: none wants no more than its match would draft (no match: nothing,
    not even a probe), and its acceptance leans on that of the lane's drafts from matches as long.
    With `lookup_quotes` too, lookup sits beside a draft model: a sequence quoting its context (a match
    whose run is QUOTE_RUN or more) drafts by lookup, free and as deep as the quote goes, where its
    tokens do not depend on the drafter (greedy, or deterministic drafts: `capped`); the draft model
    drafts the rest. Under load, where a draft model no longer pays (its forwards and catching up cost
    about what its accepted tokens save), quotes still do. `Plan.runs` says which drafter a sequence's
    depth is for: a match's run class for lookup, 0 for the draft model. `extra_levels`: draft forwards
    the call makes beyond the depth (a pre-draft, `ahead.ahead_request`, drafts its guess first).
    """
    priced = costs if config.load_adaptive else None
    # A step always adds one token, so a sequence drafts at most max_tokens - len(output) - 1.
    # A request may cap its own depth (`max_draft_tokens`; 0: no speculation for it).
    room = [max(min(s.params.max_tokens - len(s.output) - 1, _own_cap(s)), 0) for s in seqs]
    capped = [s.params.greedy or not drafts_sampled for s in seqs]
    wants = _own_wants(seqs, room, capped, config, priced is not None)
    matches = _lookup_matches(seqs, room, wants, capped, cap, lookup, lookup_quotes)
    wants = [found if n else min(w, found) for w, (n, found) in zip(wants, matches, strict=True)]
    runs = [n for n, _ in matches]
    free = [bool(n) for n in runs]  # drafts by lookup: no draft forward, nothing to catch up on
    catch_ups = [0 if f else catch_up(s) for s, f in zip(seqs, free, strict=True)]  # lookup keeps no cache
    if priced is None:
        return Plan([min(w, cap) for w in wants], runs, catch_ups, None)
    acceptances = _acceptances(seqs, runs, priced, config)
    charged = _charged_catch_ups(seqs, catch_ups, acceptances, wants)
    probes = _due_probes(seqs, catch_ups, priced, config)
    # Lookup's estimates from short runs are the least sure (chance matches, right under a third of the
    # time on the load sweep's mix), so their drafted tokens must come at `lookup_min_gain` of plain
    # decoding's price; drafts from runs of QUOTE_RUN tokens or more are quotes and get the common
    # margin, so a sequence quoting its prompt drafts under load.
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
    """Each sequence's depth by its own evidence (acceptance, rounds since it drafted), within its room.

    A sequence's first round is its prefill alone: drafting in it would have the draft model prefill
    the prompt before the target can start, delaying the first token (and, in a batch, everyone's
    round) for at most a round's worth of drafted tokens. Priced (`priced`), capped sequences draft
    from their second round."""
    wants = [
        min(own_depth(s.acceptance, s.stats.steps - s.stats.drafted_at, config), r)
        for s, r in zip(seqs, room, strict=True)
    ]
    if priced:
        wants = [0 if c and not s.stats.steps else w for s, w, c in zip(seqs, wants, capped, strict=True)]
    return wants


def _lookup_matches(
    seqs: Seq[Sequence],
    room: list[int],
    wants: list[int],
    capped: list[bool],
    cap: int,
    lookup: PromptLookupDrafter | None,
    lookup_quotes: bool,
) -> list[tuple[int, int]]:
    """Per sequence (the match's run class, tokens the lookup would draft), looked up only where a draft
    is wanted; (0, want) when the drafter is not lookup. Beside a draft model (`lookup_quotes`), only
    capped sequences past their prefill look for a quote, as deep as their room allows (a quote costs no
    draft forward), and a match shorter than QUOTE_RUN is left to the draft model."""
    if lookup_quotes and lookup:
        looked = [min(r, cap) if c and s.stats.steps else 0 for s, r, c in zip(seqs, room, capped, strict=True)]
        found = [lookup.match(s.tokens, n) if n else (0, 0) for s, n in zip(seqs, looked, strict=True)]
        return [(n, f) if n >= QUOTE_RUN and f else (0, w) for (n, f), w in zip(found, wants, strict=True)]
    return [lookup.match(s.tokens, min(w, cap)) if lookup and w else (0, w) for s, w in zip(seqs, wants, strict=True)]


def _charged_catch_ups(
    seqs: Seq[Sequence], catch_ups: list[int], acceptances: list[float], wants: list[int]
) -> list[float]:
    """Catching up is paid once and lets the sequence draft for the rest of its output: each round is
    charged its share, over the rounds the sequence still has to go at its own depth."""
    rounds_left = [
        max((s.params.max_tokens - len(s.output)) / expected_tokens(a, max(w, 1)), 1.0)
        for s, a, w in zip(seqs, acceptances, wants, strict=True)
    ]
    return [c / r for c, r in zip(catch_ups, rounds_left, strict=True)]


def _due_probes(seqs: Seq[Sequence], catch_ups: list[int], costs: StepCosts, config: DepthConfig) -> dict[int, float]:
    """Every probe_every-th round is a probe round for sequences that have not drafted for as long:
    index -> the tokens its probe catches up on."""
    if costs.rounds % config.probe_every != config.probe_every - 1:
        return {}
    held = (i for i, s in enumerate(seqs) if s.stats.steps - s.stats.drafted_at > config.probe_every)
    return {i: float(catch_ups[i]) for i in held}


def _acceptances(seqs: Seq[Sequence], runs: list[int], costs: StepCosts, config: DepthConfig) -> list[float]:
    """Each sequence's acceptance estimate for this round's drafter.

    A new sequence's estimate leans on its prior for a few steps: the lane's recent acceptance, not
    a constant, so a workload the draft guesses badly does not draft on every arrival. A lookup match
    leans on the lane's drafts from matches in its class, and before there are any on what the run
    itself says (`run_prior`): a class that never drafted under load would otherwise stay at the
    configured prior, too low to draft at, and never show what its drafts are worth."""
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
    the lane's (`prior`, 4 decisions' worth): chance matches in a preamble that missed say little about
    the long runs of the code the sequence then quotes."""
    accepted, trials = seq.stats.lookup_tally.get(run, (0.0, 0.0))
    return min(max((accepted + 4.0 * prior) / (trials + 4.0), 1e-3), 0.999)


def _own_cap(seq: Sequence) -> int:
    """The request's `max_draft_tokens`; without one, no cap beyond the server's."""
    own = seq.params.max_draft_tokens
    return own if own is not None else seq.params.max_tokens
