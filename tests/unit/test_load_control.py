"""Per-sequence depths follow measured costs: deep when verify is flat, zero when it is linear."""

from __future__ import annotations

import pytest

from speculative.adaptive import AdaptiveConfig, AdaptiveDepth
from speculative.decoder import Sequence
from speculative.load_control import StepCosts, choose_depths
from speculative.sampling import SamplingParams
from speculative.tree import TokenTree


def costs(verify: dict[int, float], draft_step: dict[int, float]) -> StepCosts:
    c = StepCosts()
    for tokens, seconds in verify.items():
        c.verify.observe(tokens, seconds)
    for sequences, seconds in draft_step.items():
        c.draft_step.observe(sequences, seconds)
    return c


# A CPU-like verify: flat to 8 tokens, then linear (MODELS.md, Qwen 1.5B bf16: 190 ms, x2.06 at 32).
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


def test_under_load_the_predictable_sequence_keeps_drafting() -> None:
    """A sequence quoting its prompt (a = 0.95) drafts deep while its neighbours (a = 0.3) stop."""
    c = costs(CPU, {16: 0.001})  # prompt lookup: drafting is nearly free
    depths = choose_depths([4] * 16, [0.95] + [0.3] * 15, c, 4)
    assert depths[0] >= 3 and depths[1:] == [0] * 15


def test_never_above_what_sequences_want_or_the_cap() -> None:
    c = costs({1: 0.1, 64: 0.1}, {1: 0.0001})  # free verify and draft: as deep as allowed
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
    assert c.verify(2) == pytest.approx(1.0)  # flat below the smallest
    assert c.verify(10) == pytest.approx(1.5)  # linear between
    assert c.verify(32) == pytest.approx(3.333, rel=1e-3)  # along the last slope
    single = costs({8: 1.0}, {})
    assert single.verify(64) == pytest.approx(1.0)  # one point: flat, so larger forwards get tried


def test_prefill_rounds_are_measured_by_their_prompt_tokens() -> None:
    joining = Sequence("a", list(range(10)), SamplingParams(), AdaptiveDepth(AdaptiveConfig()))
    running = Sequence("b", [1, 2], SamplingParams(), AdaptiveDepth(AdaptiveConfig()))
    running.stats.steps = 1
    c = StepCosts()
    c.observe_verify([joining, running], [TokenTree.chain(9, []), TokenTree.chain(2, [3, 4, 5])], 0.5)
    assert [(p.x, p.seconds) for p in c.verify.points.values()] == [(14, 0.5)]  # 10 prompt + root and 3 nodes


def test_first_draft_of_a_sequence_is_not_a_measurement() -> None:
    """The draft model prefills a new sequence's prompt: a one-off, not the cost of drafting."""
    seq = Sequence("a", list(range(100)), SamplingParams(), AdaptiveDepth(AdaptiveConfig()))
    c = StepCosts()
    c.observe_draft([seq], [TokenTree.chain(99, [1, 2])], 2.0)
    assert not c.draft_step.points
    seq.stats.drafted = 2
    c.observe_draft([seq], [TokenTree.chain(99, [1, 2])], 0.2)
    assert [(p.x, p.seconds) for p in c.draft_step.points.values()] == [(1, 0.1)]  # per unit of depth
