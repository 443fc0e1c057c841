"""Per-sequence depths follow measured costs: deep when verify is flat, zero when it is linear."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from speculative.drafters.lookup import PromptLookupDrafter
from speculative.planning.costs import Planned, StepCosts, catch_up
from speculative.planning.depth import DepthConfig, own_depth
from speculative.planning.load_control import Plan, plan_depths
from speculative.planning.load_control import choose_depths as choose_planned_rows
from speculative.planning.round import Speculation
from speculative.planning.rows import DraftRow, RoundShape, draft_rows
from speculative.planning.sequence import Sequence
from speculative.rules.sampling import SamplingParams
from speculative.rules.tree import TokenTree

CONFIG = DepthConfig()
FREE = DepthConfig(draft_cost=0.0)  # a sequence's own rule drafts as deep as allowed (prompt lookup's)


def costs(verify: dict[int, float], draft_step: dict[int, float]) -> StepCosts:
    c = StepCosts()
    for tokens, seconds in verify.items():
        c.verify.observe(tokens, seconds)
    for sequences, seconds in draft_step.items():
        c.draft_step.observe(sequences, seconds)
    return c


GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def choose_planned(
    wants: list[int],
    acceptances: list[float],
    c: StepCosts,
    cap: int,
    overlapped: bool = False,
    capped: list[bool] | None = None,
    catch_ups: list[float] | None = None,
    probes: dict[int, float] | None = None,
    min_gains: list[float] | None = None,
    extra_levels: int = 0,
) -> tuple[list[int], Planned | None]:
    """`load_control.choose_depths` over rows with these wants, acceptances, caps, catch-ups, probes (index ->
    its catch-up) and margins (default: `min_gain`)."""
    n = len(wants)
    rows = [
        DraftRow(
            wants[i],
            cap,
            acceptances[i],
            min_gains[i] if min_gains else c.config.min_gain,
            capped[i] if capped else True,
            catch_ups[i] if catch_ups else 0.0,
            (probes or {}).get(i),
        )
        for i in range(n)
    ]
    return choose_planned_rows(rows, c, RoundShape(cap, cap, overlapped, extra_levels))


def choose_depths(*args: Any, **kwargs: Any) -> list[int]:
    """The depths `load_control.choose_depths` chooses (its prediction dropped)."""
    return choose_planned(*args, **kwargs)[0]


def plan_seqs(
    seqs: list[Sequence],
    config: DepthConfig,
    c: StepCosts | None,
    cap: int,
    lookup: PromptLookupDrafter | None = None,
    overlapped: bool = False,
    extra_levels: int = 0,
) -> Plan:
    """The plan for `seqs` at depth cap `cap` (a quote's too), as `round.Speculation.depths` makes it (pure)."""
    shape = RoundShape(cap, cap, overlapped, extra_levels)
    priced = c if config.load_adaptive else None
    return plan_depths(draft_rows(seqs, shape, Speculation(config, c, lookup=lookup), priced), shape, priced)


def plan(
    seqs: list[Sequence],
    c: StepCosts | None,
    cap: int,
    config: DepthConfig = CONFIG,
    lookup_quotes: bool = False,
    lookup: PromptLookupDrafter | None = None,
) -> list[int]:
    """Plan a round and record it on the sequences, as `round.Speculation.plan` does; its depths."""
    speculation = Speculation(config, c, lookup=lookup, lookup_quotes=lookup_quotes)
    shape = RoundShape(cap, cap)
    priced = c if config.load_adaptive else None
    planned = plan_depths(draft_rows(seqs, shape, speculation, priced), shape, priced)
    speculation.record(seqs, planned)
    return planned.depths


# A CPU-like verify: flat to 8 tokens, then linear (docs/models.md, Qwen 1.5B bf16: 190 ms, x2.06 at 32).
CPU = {1: 0.19, 8: 0.21, 16: 0.28, 32: 0.39, 64: 0.78, 128: 1.56, 256: 3.12}


def test_unmeasured_drafts_as_deep_as_allowed() -> None:
    assert choose_depths([4, 2], [0.8, 0.8], StepCosts(), 3) == [3, 2]
    c = StepCosts()
    c.verify.observe(1, 0.2)  # verify measured, draft not yet: try it once to learn D
    assert choose_depths([4], [0.8], c, 4) == [4]


def test_single_stream_with_cheap_draft_speculates_deep() -> None:
    c = costs(CPU, {1: 0.01})
    assert choose_depths([6], [0.85], c, 6)[0] >= 4


def test_heavy_load_on_a_linear_verify_turns_speculation_off() -> None:
    c = costs(CPU, {32: 0.12})
    assert choose_depths([4] * 32, [0.8] * 32, c, 4) == [0] * 32


def test_low_acceptance_turns_speculation_off() -> None:
    c = costs(CPU, {1: 0.08})
    assert choose_depths([4], [0.05], c, 4) == [0]


# A GPU-like verify: flat until the forward turns compute-bound.
FLAT = {1: 0.02, 16: 0.02, 64: 0.021, 256: 0.03, 1024: 0.08}


def test_under_load_the_predictable_sequence_keeps_drafting() -> None:
    """On a flat verify a sequence quoting its prompt (a = 0.95) drafts as deep as allowed under load;
    drafted tokens cost next to nothing, so its neighbours (a = 0.3) draft too."""
    c = costs(FLAT, {16: 0.0001})  # prompt lookup: drafting is nearly free
    depths = choose_depths([4] * 16, [0.95] + [0.3] * 15, c, 4)
    assert depths[0] == 4 and all(d >= 2 for d in depths)


def test_on_a_linear_verify_only_the_predictable_sequence_drafts() -> None:
    """On a CPU's linear verify a forward is packed (a drafted token costs one token, not a padded
    row per sequence): the sequence quoting its prompt drafts deep among 16, the others do not."""
    c = costs(CPU, {16: 0.0001})
    assert choose_depths([4] * 16, [0.95] + [0.3] * 15, c, 4) == [4] + [0] * 15


def test_never_above_what_sequences_want_or_the_cap() -> None:
    c = costs({1: 0.1, 2: 0.1, 64: 0.1}, {1: 0.0001})  # free verify and draft: as deep as allowed
    assert choose_depths([2, 3], [0.99, 0.99], c, 8) == [2, 3]
    assert choose_depths([8, 8], [0.99, 0.99], c, 5) == [5, 5]


def test_uncapped_sequences_keep_their_depth() -> None:
    """Sampled drafts: depth would change a seeded output, so load does not set it."""
    c = costs(CPU, {32: 0.12})
    depths = choose_depths([4] * 32, [0.8] * 32, c, 4, capped=[False] + [True] * 31)
    assert depths[0] == 4


def test_overlapped_draft_is_hidden_behind_verify() -> None:
    c = costs(CPU, {1: 0.05})  # a draft step a quarter of a verify: in sequence, deep drafts cost too much
    assert choose_depths([4], [0.7], c, 4) == [2]
    assert choose_depths([4], [0.7], c, 4, overlapped=True) == [4]


def test_curve_interpolates_and_extrapolates() -> None:
    c = costs({4: 1.0, 16: 2.0}, {})
    assert c.verify(2) == pytest.approx(0.8333, rel=1e-3)  # below the smallest along the first slope
    assert c.verify(1) == pytest.approx(0.75)
    assert costs({4: 1.0, 8: 5.0}, {}).verify(2) == pytest.approx(0.5)  # never below proportional
    assert c.verify(10) == pytest.approx(1.5)  # linear between
    assert c.verify(32) == pytest.approx(3.333, rel=1e-3)  # along the last slope
    single = costs({8: 1.0}, {})
    assert single.verify(64) == pytest.approx(1.0)  # one point: flat, so larger forwards get tried


def test_a_drafted_token_is_priced_by_a_slope_over_well_spread_sizes() -> None:
    """A plain round of 16 and one of 17 (a token drafted) land in neighbouring buckets; their slope is
    mostly noise (here 33 ms for a token that costs about 8.5)."""
    c = costs({8: 0.217, 16: 0.279, 17: 0.312, 45: 0.543}, {})
    per_token = (c.verify(20) - c.verify(16)) / 4
    assert 0.007 < per_token < 0.011
    assert c.verify(16) == pytest.approx(0.279, rel=0.06)


def test_prefill_rounds_are_measured_by_their_prompt_tokens() -> None:
    joining = Sequence("a", list(range(10)), SamplingParams())
    running = Sequence("b", [1, 2], SamplingParams())
    running.stats.steps = 1
    c = StepCosts()
    c.observe_verify([joining, running], [TokenTree.chain(9, []), TokenTree.chain(2, [3, 4, 5])], 0.5)
    assert [(p.x, p.seconds) for p in c.verify.points.values()] == [(14, 0.5)]  # 10 prompt + 1 + 3, packed


def test_catching_up_is_priced_per_token_not_as_a_round() -> None:
    """The draft model prefills a new sequence's prompt, or catches up on one that has not drafted
    for a while: that call measures catching up per token, and a round that needs it pays for it."""
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    seq = Sequence("a", list(range(100)), greedy)
    seq.stats.steps = 1  # prefilled by the target (its first round), not yet by the draft model
    c = costs({1: 0.2, 2: 0.2, 8: 0.21}, {})
    assert plan([seq], c, 2) == [2]  # unmeasured: drafts, and records its catch-up (the prompt)
    assert seq.stats.draft_catch_up == 100
    c.observe_draft([seq], [TokenTree.chain(99, [1, 2])], 2.0)
    assert not c.draft_step.points  # no round cost to subtract yet: the whole call prices catching up
    assert c.draft_token == pytest.approx(0.02)  # 2.0 / 100, an upper bound (never free: see below)
    seq.stats.draft_catch_up = 0  # a round that caught up on nothing: the round's cost
    c.observe_draft([seq], [TokenTree.chain(99, [1, 2])], 0.1)
    assert [(p.x, p.seconds) for p in c.draft_step.points.values()] == [(1, 0.05)]  # per unit of depth
    c.draft_token = None  # as a lane whose first catch-up came after a measured round
    seq.stats.draft_catch_up = 100
    c.observe_draft([seq], [TokenTree.chain(99, [1, 2])], 1.1)
    assert c.draft_token == pytest.approx(0.01)  # (1.1 - 2 * 0.05) / 100
    assert [(p.x, p.seconds) for p in c.draft_step.points.values()] == [(1, 0.05)]
    seq.stats.steps, seq.stats.drafted_at = 60, 10  # not drafted for 50 rounds: 60 tokens to catch up
    seq.output = list(range(60))
    assert catch_up(seq) == 160 - seq.stats.draft_synced
    seq.stats.draft_synced = 100
    assert plan([seq], c, 4) == [0]  # 0.6 s of catch-up for the 4 tokens left: not worth it
    seq.stats.drafted_at = 59  # had it drafted last round, the same drafts would pay
    assert plan([seq], c, 4) != [0]
    seq.params = SamplingParams(temperature=0.0, max_tokens=1000)
    seq.stats.drafted_at = 10  # with 940 tokens to go, catching up is paid back many times over
    assert plan([seq], c, 4) != [0]


def test_new_sequences_start_from_the_lanes_acceptance_not_a_constant() -> None:
    """The lane has seen 1 in 4 drafts accepted, so sequences that just joined do not draft on the
    configured prior (0.7) alone; a sequence's own evidence takes over as it comes."""
    c = costs({1: 0.2, 4: 0.2, 16: 0.2, 32: 0.25}, {1: 0.03, 4: 0.06})  # a drafted token: 0.06 s / 4
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    fresh = [Sequence(f"s{i}", [1, 2, 3], greedy) for i in range(4)]
    for seq in fresh:
        seq.stats.steps = 1  # past their prefill round
    assert plan(fresh, c, 4) != [0] * 4  # nothing pooled yet: the configured prior drafts
    for _ in range(50):  # drafts of 1 token, one in four kept
        c.observe_verify(fresh, [TokenTree.chain(3, [7])] * 4, 0.2, [1, 0, 0, 0])
    assert c.acceptance_prior(0.7) == pytest.approx(0.25, abs=0.06)
    assert plan(fresh, c, 4) == [0] * 4
    quoting = fresh[0].acceptance
    for _ in range(10):
        quoting.update(4, 4, CONFIG.memory)  # this sequence's own drafts all land
    assert plan(fresh, c, 4)[0] > 0
    assert quoting.estimate(0.25) == pytest.approx(quoting.estimate(0.7), abs=0.03)  # its own evidence rules


def test_a_sequence_s_first_round_is_its_prefill_alone() -> None:
    """Drafting in a prompt's first round would have the draft model prefill it before the target
    starts: the first token (and a batch's whole round) waits. Greedy sequences draft from round two;
    sampled drafts, whose depth must not depend on load, keep theirs."""
    c = costs({1: 0.2, 2: 0.2, 4: 0.2, 16: 0.2, 64: 0.25}, {1: 0.01, 4: 0.01})
    joining = Sequence("new", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=64))
    running = Sequence("old", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=64))
    running.stats.steps, running.stats.drafted_at = 5, 4  # drafted last round: nothing to catch up
    assert plan([joining], c, 4) == [0]
    depths = plan([joining, running], c, 4)
    assert depths[0] == 0 and depths[1] > 0
    assert plan([joining], None, 4) != [0]  # no load control: depth by acceptance alone
    sampled = Sequence("s", [1, 2, 3], SamplingParams(temperature=1.0, max_tokens=64))
    assert plan([sampled], c, 4) != [0]


def test_a_request_caps_its_own_depth_and_zero_turns_speculation_off() -> None:
    """`max_draft_tokens` binds with or without load control, measured or not, greedy or sampled."""
    c = costs({1: 0.2, 2: 0.2, 4: 0.2, 16: 0.2, 64: 0.25}, {1: 0.01, 4: 0.01})

    def seq(name: str, **params: Any) -> Sequence:
        s = Sequence(name, [1, 2, 3], SamplingParams(max_tokens=64, **params))
        s.stats.steps, s.stats.drafted_at = 5, 4
        return s

    for greedy in (0.0, 1.0):
        free, one, off = (
            seq("a", temperature=greedy),
            seq("b", temperature=greedy, max_draft_tokens=1),
            seq("c", temperature=greedy, max_draft_tokens=0),
        )
        for control in (None, StepCosts(), c):
            depths = plan([free, one, off], control, 4, config=FREE)  # on its own, as deep as allowed
            assert depths[0] > 1 and depths[1] == 1 and depths[2] == 0, (greedy, control, depths)
    with pytest.raises(ValidationError, match="max_draft_tokens"):
        SamplingParams(max_draft_tokens=-1)


def test_drafting_that_does_not_deliver_what_was_predicted_stops_and_is_tried_again_later() -> None:
    c = costs({1: 0.2, 4: 0.2, 16: 0.22}, {4: 0.06})  # drafting predicted about 1.5x plain
    wants, acc = [4] * 4, [0.8] * 4
    depths, predicted = choose_planned(wants, acc, c, 4)
    assert depths != [0] * 4 and predicted is not None
    base, drafted = predicted.base, predicted.drafted
    for _ in range(20):  # each drafting round commits 2 of the ~8 drafted tokens expected (lucky estimates)
        c.observe_round(predicted, int(base) + 2)
    assert c.calibration == pytest.approx(2 / drafted, abs=0.03)
    assert choose_planned(wants, acc, c, 4) == ([0] * 4, None)
    for _ in range(250):  # plain rounds: the calibration drifts back, and drafting is tried again
        c.verify.observe(4, 0.2)
        c.observe_round(None, 4)
    assert choose_depths(wants, acc, c, 4) != [0] * 4


def test_draft_calls_slower_than_planned_make_drafting_pricier_until_they_are_not() -> None:
    """A sequence that drafts now and then pays its catch-up again each time it resumes, while the plan
    spread it over the rounds left: the calls take longer than planned, and drafting stops paying."""
    c = costs({1: 0.2, 4: 0.2, 16: 0.22}, {4: 0.06})
    wants, acc = [4] * 4, [0.8] * 4
    seqs = [Sequence(f"s{i}", [1, 2, 3], GREEDY) for i in range(4)]
    trees = [TokenTree.chain(3, [7, 8, 9])] * 4
    depths, planned = choose_planned(wants, acc, c, 4)
    assert depths == [3] * 4 and planned is not None and planned.draft_seconds == pytest.approx(0.18)
    c.observe_draft(seqs, trees, planned.draft_seconds, planned)  # as planned: no change
    assert c.draft_calibration == pytest.approx(1.0)
    for seq in seqs:
        seq.stats.draft_catch_up = 10  # each resumed, catching up on 10 tokens
    for _ in range(20):  # and each call takes 4x its plan
        c.observe_draft(seqs, trees, 4 * planned.draft_seconds, planned)
    assert c.draft_calibration > 3.5
    assert c.draft_step(4) == pytest.approx(0.06)  # catch-up calls price catching up, not a round
    assert choose_depths(wants, acc, c, 4) == [0] * 4
    for _ in range(400):  # plain rounds: it drifts back, and drafting is tried again
        c.observe_round(None, 4)
    assert choose_depths(wants, acc, c, 4) != [0] * 4


def test_a_lane_whose_first_drafts_missed_keeps_trying() -> None:
    """Prompt lookup's first match after a chat prompt is often junk: one missed round must not set
    the lane's acceptance (and so every sequence's) to zero for good."""
    c = StepCosts()
    seq = Sequence("a", [1, 2, 3], SamplingParams(temperature=0.0))
    c.observe_verify([seq], [TokenTree.chain(3, [7, 8, 9, 10])], 0.2, [0])
    assert c.acceptance_prior(0.7) == pytest.approx(0.56)


def test_a_sequence_held_at_zero_probes_when_a_probe_is_cheap() -> None:
    """A sequence whose estimate fell during a preamble would otherwise never draft again, although
    the quoted code it writes next is what its drafter guesses best: on every probe_every-th round,
    sequences held at 0 that long draft one token, if that makes the round at most probe_cost longer."""
    greedy = SamplingParams(temperature=0.0, max_tokens=200)
    seq = Sequence("a", [1, 2, 3], greedy)
    seq.acceptance.accepted, seq.acceptance.trials, seq.acceptance.prior_weight = 1.5, 10.0, 0.0  # 0.15
    seq.stats.steps, seq.stats.drafted_at = 20, 11  # 9 rounds at 0
    # Prompt lookup (free drafts); a second token costs the forward 2.5 %: drafting at a = 0.15, in a
    # lane whose drafts delivered a tenth of what was expected, does not pay; a probe costs less than
    # probe_cost (and is how the lane finds out whether this sequence's drafts land now).
    mild = costs({1: 0.2, 2: 0.205, 4: 0.24, 8: 0.25}, {1: 0.0001})
    mild.calibration = 0.1
    assert plan([seq], mild, 4, FREE) == [0]  # not a probe round
    mild.rounds = FREE.probe_every - 1  # the next round is one
    assert plan([seq], mild, 4, FREE) == [1]
    assert seq.stats.drafted_at == 20  # the probe counts as drafting: not due again for 8 rounds
    seq.stats.drafted_at = 11
    steep = costs({1: 0.2, 2: 0.4, 4: 0.45, 8: 0.5}, {1: 0.0001})  # a second token doubles the forward
    steep.rounds = FREE.probe_every - 1
    assert plan([seq], steep, 4, FREE) == [0]


def test_no_probe_where_even_good_drafts_would_not_pay() -> None:
    """A probe finds out whether a held sequence's drafts land now. Beside a 32-row round whose
    every extra token costs 17 ms (2 % of the round: within probe_cost), prompt lookup's drafts,
    counted at half (lookup_min_gain), would not pay even if right 90 % of the time, so whatever a
    probe found would change nothing and none is made. At 5 ms a token such drafts would pay,
    while this sequence's own (acceptance 0.15) still do not: there it probes."""
    due = {0: 0.0}  # sequence 0 is due a probe, nothing to catch up on (lookup)
    for slope, probes in [(0.017, False), (0.005, True)]:
        c = costs({32: 0.78, 64: 0.78 + 32 * slope}, {1: 0.0001, 32: 0.0001})
        depths = choose_depths([4] * 32, [0.15] * 32, c, 4, probes=due, min_gains=[CONFIG.lookup_min_gain] * 32)
        assert depths == [int(probes)] + [0] * 31, slope


def test_prompt_lookup_depths_follow_each_sequence_s_match() -> None:
    """Lookup drafts cost nothing to find, so depths are weighed knowing them: no match, no draft (not
    even a probe); never deeper than the match has tokens; and under load a sequence quoting its prompt
    (a long run of agreeing tokens, as quoted code gives) drafts while one with a chance match does not,
    even if its own chance drafts missed before it started quoting."""
    lookup = PromptLookupDrafter(max_ngram=3)

    def seq(name: str, tokens: list[int]) -> Sequence:
        s = Sequence(name, tokens, GREEDY)
        s.stats.steps, s.stats.drafted_at = 5, 4
        return s

    # the prompt 5..16 quoted from its start: 10 tokens agree, then 15 16 40 41 follow
    quoting = seq("q", [*range(5, 17), 40, 41, *range(5, 15)])
    chance = seq("c", [20, 21, 22, 23, 24, 25, 26, 27, 28, 21])  # only "21" seen before
    short = seq("s", [30, 7, 7, 7, 7])  # "7 7 7" seen one token back: one token (7) follows
    nothing = seq("n", [40, 41, 42, 43, 44, 45, 46, 47, 48, 49])
    assert plan([quoting, chance, short, nothing], StepCosts(), 4, FREE, lookup=lookup) == [4, 4, 1, 0]
    assert [s.stats.lookup_run for s in (quoting, chance, short, nothing)] == [8, 1, 2, 0]  # run classes

    # A CPU under load (16 sequences, a drafted token costs a fifth of a decode step's share), where
    # the lane's quoted drafts have landed and its chance ones have not; this sequence's own chance
    # drafts (its preamble) missed too.
    c = costs(CPU, {16: 0.0001})
    for _ in range(30):
        c.observe_verify([quoting], [TokenTree.chain(7, [8, 9])], 0.2, [2])
        c.observe_verify([chance], [TokenTree.chain(21, [22])], 0.2, [0])
    quoting.stats.lookup_run = 1
    quoting.stats.lookup_tally.clear()
    for _ in range(3):
        c.observe_verify([quoting], [TokenTree.chain(7, [99])], 0.2, [0])
        quoting.acceptance.update(1, 0, FREE.memory)  # as the round records it when it settles
    assert c.acceptance_prior(0.7, 8) > 0.9 and c.acceptance_prior(0.7, 1) < 0.2
    c.verify.observe(16, CPU[16])  # a plain round of 16 just measured (what drafting is weighed against)
    batch = [quoting] + [seq(f"c{i}", chance.tokens) for i in range(15)]
    depths = plan(batch, c, 4, FREE, lookup=lookup)
    assert depths[0] == 4 and depths[1:] == [0] * 15
    # Blind to the matches, it is the other way round: the quoting sequence is held back by its own
    # misses, and the chance matches draft on the lane's record (mostly the quoting drafts).
    blind = plan(batch, c, 4, FREE)
    assert blind[0] == 0 and all(blind[1:])


def test_quoted_lookup_drafts_pay_the_common_margin() -> None:
    """Drafts from chance matches count at half (their estimates run high: lucky sequences look good);
    drafts from a quote (a run of QUOTE_RUN or more) at the common margin. At c = 16 on a CPU, where a
    drafted token costs about half a plain token's share of the step, a quote right 95 % of the time
    drafts and a chance match with the same estimate does not."""
    lookup = PromptLookupDrafter(max_ngram=3)
    c = costs({16: 0.19, 32: 0.28}, {16: 0.0001})  # 11.9 ms per plain token, 5.6 ms per drafted one
    quoted = [*range(100, 116), *range(100, 110)]  # a run of 10: class 8
    chance = [*range(200, 230), 205]  # "205" seen once before: class 1
    batch = [Sequence(f"s{i}", quoted if i < 2 else chance, GREEDY) for i in range(16)]
    for s in batch:
        s.stats.steps, s.stats.drafted_at = 5, 4
    for run in (8, 1):  # the lane: 95 % of both kinds of draft landed
        c.pooled_by_match[run] = (95.0, 100.0)
    depths = plan(batch, c, 4, FREE, lookup=lookup)
    assert [s.stats.lookup_run for s in batch[:3]] == [8, 8, 1]
    assert depths[:2] == [4, 4] and depths[2:] == [0] * 14


def test_prompt_lookup_drafts_are_free_and_never_wait_for_a_draft_measurement() -> None:
    """A draft model prefills each sequence it has not drafted for and its rounds are measured; prompt
    lookup has no cache and no forward, so its drafts cost nothing to catch up on, its rounds measure
    nothing, and a lane that never called a draft model plans from the verify curve alone: with the
    draft side unmeasured, a draft model's lane drafts as deep as allowed once to learn it, which a
    lookup lane must not (it would draft its chance matches unpriced, round after round)."""
    lookup = PromptLookupDrafter(max_ngram=3)
    quoting = Sequence("q", list(range(40)) + [5, 6, 7], GREEDY)
    quoting.stats.steps = 1  # prefilled; never drafted
    c = costs(CPU, {})
    (depth,) = plan([quoting], c, 4, FREE, lookup=lookup)
    assert depth == 4 and quoting.stats.draft_catch_up == 0  # a quote at one stream: as deep as allowed
    c.observe_draft([quoting], [TokenTree.chain(7, [8, 9, 10, 11])], 0.0004)
    assert not c.draft_step.points and c.draft_token is None  # nothing measured
    chance = [*range(200, 230), 205]  # "205" seen once before: a chance match
    batch = [Sequence(f"c{i}", chance, GREEDY) for i in range(16)]
    for s in batch:
        s.stats.steps = 1
    assert plan(batch, c, 4, FREE, lookup=lookup) == [0] * 16  # weighed at once: chance drafts do not pay


def test_catching_up_is_priced_from_the_lane_s_first_draft_call() -> None:
    """A lane's first draft call catches up on every prompt, before any round is measured. Its seconds
    price catching up (the whole call: an upper bound), so 16 sequences that would each catch up on a
    70-token prompt to draft are seen to cost that; left unpriced, catching up would cost nothing in
    every plan until a call came after a measured round."""
    seqs = [Sequence(f"s{i}", list(range(70)), GREEDY) for i in range(16)]
    for s in seqs:
        s.stats.steps, s.stats.draft_catch_up = 1, 70
    c = costs({16: 0.27, 32: 0.39, 80: 0.9, 1120: 5.6}, {})
    c.observe_draft(seqs, [TokenTree.chain(69, [1, 2])] * 16, 1.3)  # 1,120 prompt tokens caught up
    assert c.draft_token == pytest.approx(1.3 / 1120)
    c.draft_step.observe(16, 0.08)  # later rounds, nothing to catch up on: 80 ms per unit of depth
    charged = [70 / 10] * 16  # each prompt's catch-up spread over the 10 rounds its sequence has left
    assert choose_depths([2] * 16, [0.9] * 16, c, 4, catch_ups=charged) == [0] * 16
    c.draft_token = None  # unpriced: one token each looks worth drafting
    assert choose_depths([2] * 16, [0.9] * 16, c, 4, catch_ups=charged) == [1] * 16


def test_beside_a_draft_model_a_quote_drafts_by_lookup_where_the_model_no_longer_pays() -> None:
    """Under load on a CPU the draft model is priced out (its forwards cost about what its accepted
    tokens save), but a sequence quoting its context still drafts: by lookup, free and as deep as the
    quote and its room allow, even though the model's own estimate for it says not to draft. A chance
    match whose class lands more often than the model (2/3 before evidence against the model's 0.3) drafts by
    lookup too, but at its margin it does not pay under this load; a sequence whose tokens depend on its
    drafter (sampled drafts under sampling) is left to the model. The draft model is not told a quoting
    sequence drafted: it will have those tokens to catch up on if the model drafts for it later."""
    lookup = PromptLookupDrafter(max_ngram=3)
    quoted = [*range(100, 116), *range(100, 110)]  # the prompt 100..115 quoted for 10 tokens: a run of 10
    chance = [*range(200, 230), 205]  # "205" seen once before: a run of 1
    model_depth = DepthConfig(draft_cost=0.35, prior_acceptance=0.3)  # on its own, the model drafts nothing

    def seq(name: str, tokens: list[int], params: SamplingParams = GREEDY) -> Sequence:
        s = Sequence(name, tokens, params)
        s.stats.steps, s.stats.drafted_at, s.stats.draft_synced = 5, 4, len(tokens) - 1
        return s

    sampled = SamplingParams(temperature=0.8, max_tokens=64, seed=1)
    batch = [seq("q", quoted), seq("s", quoted, sampled)] + [seq(f"c{i}", chance) for i in range(14)]
    c = costs(CPU, {16: 0.06, 2: 0.03})  # 60 ms a unit of depth for 16 sequences: the model does not pay
    c.pooled_accepted, c.pooled_trials = 30.0, 100.0
    depths = plan(batch, c, 4, model_depth, lookup=lookup, lookup_quotes=True)
    assert [s.stats.lookup_run for s in batch[:3]] == [8, 0, 1]  # the greedy sequences draft by lookup
    assert depths[0] == 4 and depths[2:] == [0] * 14
    assert batch[0].stats.draft_synced == len(quoted) - 1  # the draft model has not seen this round
    # Without lookup beside it, the quoting sequence is the model's, and the model is priced out.
    for s in batch:
        s.stats.lookup_run = 0
    assert plan(batch, c, 4, model_depth)[0] == 0


def test_beside_a_draft_model_a_short_match_drafts_by_whichever_lands_more_often() -> None:
    """A match shorter than a quote (a run of 3: the output re-joining its prediction after an edit) drafts by
    lookup, free, where the lane's lookup drafts of its class land at least as often as the model's drafts for
    the sequence, and is left to the model where the model's land more often, unless the model's forwards cost
    more than its drafts save: then lookup drafts it after all. A request's prediction is searched as its
    context is: the same run found there drafts the prediction's next tokens."""
    lookup = PromptLookupDrafter(max_ngram=3)
    prompt, edited = [*range(100, 130)], [7, 8, 9]  # the output so far: 3 tokens, a new line after an edit
    in_context = [*range(200, 230), 7, 8, 9, 11, 12, 13]  # 7 8 9 earlier in the prompt, then 11 12 13
    with_prediction = SamplingParams(temperature=0.0, max_tokens=64, prediction=(5, 7, 8, 9, 11, 12, 13))
    c = costs(FLAT, {1: 0.01})
    c.pooled_by_match[2] = (60.0, 100.0)  # the lane's lookup drafts from runs of 2-3 land 0.6 of the time
    for s in (Sequence("c", in_context, GREEDY, list(edited)), Sequence("p", prompt, with_prediction, list(edited))):
        s.stats.steps, s.stats.drafted_at, s.stats.draft_synced = 5, 4, len(s.tokens) - 1
        c.pooled_accepted, c.pooled_trials = 30.0, 100.0  # the model's land 0.3
        speculation = Speculation(CONFIG, c, lookup=lookup, lookup_quotes=True)
        (row,) = speculation.depths([s], 1).rows
        assert row.run == 2 and row.depth >= 3
        c.pooled_accepted = 90.0  # the model's land 0.9
        (row,) = speculation.depths([s], 1).rows
        assert row.run == 0 and row.depth > 0  # the model drafts it
        dear = costs(FLAT, {1: 0.2})  # a draft forward costs 10 verifies: the model's drafts never pay
        dear.pooled_by_match, dear.pooled_accepted, dear.pooled_trials = c.pooled_by_match, 90.0, 100.0
        (row,) = Speculation(CONFIG, dear, lookup=lookup, lookup_quotes=True).depths([s], 1).rows
        assert row.run == 2 and row.depth >= 3
        c.pooled_accepted = 30.0
        drafting = speculation.plan([s], 1)
        proposal = drafting.found[0]
        assert proposal is not None and proposal.tree.tokens[:3] == (11, 12, 13)  # lookup drafted, here
        assert drafting.modelled[0].budget == 0 and s.stats.lookup_run == 2


def test_beside_a_draft_model_only_the_models_verdicts_move_its_acceptance_for_a_sequence() -> None:
    """The acceptance a sequence's model drafts are priced by is the draft model's own evidence: a quote's verdict
    (lookup drafted that round) is tallied by its run class, and leaves the model's estimate as it was, so a
    sequence that quoted well is not taken to draft well by the model. With lookup as the only drafter every
    verdict is the sequence's acceptance, as before."""

    class Verdict:
        def __init__(self, tokens: tuple[int, ...], accepted: tuple[int, ...]) -> None:
            self.tokens, self.accepted, self.logprobs = tokens, accepted, None

    tree = TokenTree.chain(9, [10, 11, 12, 13])
    for beside_model, moved in ((True, False), (False, True)):
        s = Sequence("s", [1, 2, 3, 9], GREEDY)
        before = s.acceptance.estimate(0.5)
        s.stats.lookup_run = 8  # this round drafted by lookup
        speculation = Speculation(CONFIG, None, lookup=PromptLookupDrafter(), lookup_quotes=beside_model)
        speculation.settle([s], [tree], [Verdict((10, 11, 12, 13, 14), (1, 2, 3, 4))], 0.1, None)
        assert (s.acceptance.estimate(0.5) != before) is moved
        s.stats.lookup_run = 0  # the draft model drafted: its evidence either way
        speculation.settle([s], [TokenTree.chain(14, [15, 16])], [Verdict((15, 16, 17), (1, 2))], 0.1, None)
        assert s.acceptance.estimate(0.5) > before


def test_planning_changes_nothing_until_the_round_records_it() -> None:
    """The plan is a pure function of the sequences and the measured costs: planning twice gives the same
    plan, and neither the sequences nor the costs change until `Speculation.record` (or settling) says so."""
    import copy

    lookup = PromptLookupDrafter(max_ngram=3)
    quoting = Sequence("q", [*range(5, 17), 40, 41, *range(5, 15)], GREEDY)
    held = Sequence("h", list(range(60, 100)), GREEDY)
    quoting.stats.steps, quoting.stats.drafted_at = 5, 4
    held.stats.steps, held.stats.drafted_at = 30, 3  # due a probe
    c = costs(CPU | {2: 0.19}, {2: 0.01})  # a plain round of 2 measured
    c.rounds = CONFIG.probe_every - 1  # a probe round
    c.pooled_by_match[8] = (95.0, 100.0)  # the lane's quotes have landed
    before = copy.deepcopy((quoting, held, c))
    first = plan_seqs([quoting, held], CONFIG, c, 4, lookup=lookup)
    assert plan_seqs([quoting, held], CONFIG, c, 4, lookup=lookup) == first
    assert copy.deepcopy((quoting, held, c)) == before
    assert first.rows[0].run == 8 and first.depths[0] > 0  # (a quote, drafted by lookup)
    Speculation(CONFIG, c, lookup=lookup).record([quoting, held], first)
    assert quoting.stats.lookup_run == 8 and quoting.stats.drafted_at == 5


def test_a_pre_draft_is_priced_one_forward_deeper_than_its_depth() -> None:
    """A pre-draft drafts its guess of the bonus token before the depth it is planned for, so beside a
    verify it costs D(d + 1): where that outlasts the verify, it is planned shallower than a draft of d."""
    c = costs({1: 0.36, 4: 0.48, 5: 0.5, 8: 0.55}, {1: 0.13})  # a 0.5B draft beside a 1.5B target, 1 core each
    wants, acc = [4], [0.9]
    assert choose_depths(wants, acc, c, 4, overlapped=True) == [4]  # D(4) = 0.52 hides behind V(5) = 0.5
    assert choose_depths(wants, acc, c, 4, overlapped=True, extra_levels=1) == [3]  # D(5) = 0.65 would not


def test_a_draft_hidden_behind_the_verify_goes_as_deep_as_it_pays() -> None:
    """Measured costs, not the fixed cost model of `own_depth`, bound a greedy sequence's depth: a draft
    hidden behind the verify drafts deeper than one that runs before it (a = 0.875: own_depth says 4 of 8)."""
    config = DepthConfig(max_depth=8)
    c = costs({1: 0.25, 5: 0.3, 9: 0.33, 16: 0.4}, {1: 0.036})  # 0.5B int8 draft, 1.5B bf16 verify, 1 core each
    seq = Sequence("s", [1, 2, 3], GREEDY)
    seq.stats.steps, seq.stats.drafted_at = 5, 4
    for _ in range(40):
        seq.acceptance.update(8, 7, config.memory)  # 7 of 8 levels kept: 0.875 per decision
    assert own_depth(seq.acceptance, 1, config) == 4
    hidden = plan_seqs([seq], config, c, 8, overlapped=True, extra_levels=1).depths
    alone = plan_seqs([seq], config, c, 8).depths
    assert hidden == [8]  # its 9 forwards (the guess of the bonus first), 0.32 s, hide behind V(9) = 0.33 s
    assert 4 < alone[0] < 8  # in sequence each level costs its forward: deeper than own_depth, not to the cap
    sampled = Sequence("t", [1, 2, 3], SamplingParams(temperature=1.0, max_tokens=64))
    sampled.stats.steps, sampled.acceptance = 5, seq.acceptance
    assert plan_seqs([sampled], config, c, 8, overlapped=True).depths == [4]  # its tokens depend on depth


@pytest.mark.parametrize("beside_model", [False, True])
def test_a_quote_drafts_deeper_than_max_depth(beside_model: bool) -> None:
    """A quote (a lookup match of QUOTE_RUN or more agreeing tokens: copied code) costs nothing to draft and
    lands far more often than a guess, so it may run to `max_quote_depth` while every other draft stays
    within `max_depth`: where a verify is flat in its tokens (a GPU, or a CPU up to ~24) a code edit
    commits up to 25 tokens a step instead of 9. Priced or not, prompt lookup alone or beside a model."""
    config = DepthConfig(draft_cost=0.0, max_depth=4, max_quote_depth=12)
    lookup = PromptLookupDrafter(max_ngram=3)
    quoting = Sequence("q", [*range(100, 140), *range(100, 112)], GREEDY)  # quotes its start: 28 tokens follow
    other = Sequence("o", [*range(200, 230), 205], GREEDY)  # "205" seen once: a chance match
    for s in (quoting, other):
        s.stats.steps, s.stats.drafted_at = 5, 4
    flat = costs({2: 0.2, 16: 0.2, 32: 0.21}, {2: 0.0001})  # a verify flat in its tokens, drafting nearly free
    for c in (None, flat):
        speculation = Speculation(config, c, lookup=lookup, lookup_quotes=beside_model)
        plan = speculation.depths([quoting, other], 2)
        assert plan.depths[0] == 12 and plan.rows[0].run == 8
        assert 0 < plan.depths[1] <= 4  # lookup's chance match, or the model's draft: max_depth
        assert speculation.depths([quoting, other], 16).depths[0] == 64 // 16 - 1  # the batch's budget binds


def test_a_pre_draft_deadline_learns_when_its_verdict_reaches_the_router() -> None:
    """A pre-draft drafts until its verdict is back: the verify's predicted seconds, corrected by what the
    last pre-drafts could have drafted. One that worked 0.33 s and answered 0.03 s after its verdict had
    0.30 s, against 0.32 s predicted: the deadline shortens, and one that answered early lengthens it."""
    c = StepCosts(DepthConfig(cost_memory=0.5))
    assert c.ahead_deadline(0.32) == pytest.approx(0.32)  # nothing learned: the prediction
    c.observe_ahead(0.32, 0.33 - 0.03)
    assert c.ahead_deadline(0.32) == pytest.approx(0.31)
    c.observe_ahead(0.32, 0.30 + 0.04)  # finished 0.04 s before its verdict: it had 0.34 s
    assert c.ahead_deadline(0.32) == pytest.approx(0.32 + 0.005)
    assert c.ahead_deadline(0.0) == pytest.approx(0.005) and StepCosts().ahead_deadline(-1.0) == 0.0


def test_a_verify_crowded_by_a_draft_call_prices_overlapped_drafting_and_plain_keeps_both_cores() -> None:
    """On a CPU whose target borrows the draft's core while no draft call runs (`borrow_cores`), a plain round
    verifies on two cores and a round drafting beside its verify on one: the crowded verifies are a curve of
    their own, and an overlapped round that calls the draft model is priced by it. Where the one-core verify
    with its draft loses to the two-core plain round, the round is plain; the same costs measured as if every
    verify ran alike (one curve) would have drafted."""
    one_curve = costs({1: 0.060, 5: 0.110}, {1: 0.050})
    split = costs({1: 0.060, 5: 0.110}, {1: 0.050})
    for tokens, seconds in {1: 0.100, 5: 0.190}.items():
        split.beside.observe(tokens, seconds)
    assert choose_depths([4], [0.8], one_curve, 8, overlapped=True) == [1]
    assert choose_depths([4], [0.8], split, 8, overlapped=True) == [0]
    row = DraftRow(4, 8, 0.8, 1.0)
    assert split.round_seconds([row], [0], RoundShape(8, 8, True)) == pytest.approx(0.060)
    assert split.round_seconds([row], [4], RoundShape(8, 8, True)) == pytest.approx(0.200)  # the draft: 4 x 50 ms
    # drafted by the model in sequence (no call beside the verify): both cores, as the plain round
    assert split.round_seconds([row], [4], RoundShape(8, 8, False)) == pytest.approx(0.110 + 0.200)
    # with high acceptance the crowded round still pays
    assert choose_depths([4], [0.98], split, 8, overlapped=True) == [4]


def test_crowded_verifies_age_the_plain_curve_so_a_plain_round_remeasures_it() -> None:
    seq = Sequence("a", list(range(10)), GREEDY)
    seq.stats.steps = 3
    tree = TokenTree(0, (1, 2), (0, 1))
    c = StepCosts()
    c.observe_verify([seq], [TokenTree(0, (), ())], 0.06)
    for _ in range(5):
        c.observe_verify([seq], [tree], 0.15, [2], crowded=True)
    assert c.verify.age(1) == 5 and c.beside(3) == pytest.approx(0.15) and c.verify(3) == pytest.approx(0.06)


def test_a_crowded_prefill_alone_does_not_price_small_crowded_verifies() -> None:
    """A prompt prefilled beside the draft model's catch-up is a crowded verify of many tokens: until a crowded
    verify of a round's size is measured, such rounds are priced by the plain curve (the first one measures)."""
    c = costs({1: 0.06, 5: 0.11}, {1: 0.05})
    c.beside.observe(40, 1.2)
    assert c.verify_beside(5) == pytest.approx(0.11)
    c.beside.observe(5, 0.19)
    assert c.verify_beside(5) == pytest.approx(0.19) and c.verify_beside(40) == pytest.approx(1.2)
