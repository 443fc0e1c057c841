"""The per-batch depth cap follows measured costs: deep when verify is flat, zero when it is linear."""

from __future__ import annotations

import pytest

from speculative.load_control import StepCosts, choose_cap


def costs(verify: dict[int, float], draft_step: dict[int, float]) -> StepCosts:
    c = StepCosts()
    for tokens, seconds in verify.items():
        c.observe_verify(tokens, seconds)
    for sequences, seconds in draft_step.items():
        c.observe_draft(sequences, 1, sequences, seconds)
    return c


# A CPU-like verify: flat to 8 tokens, then linear (MODELS.md, Qwen 1.5B bf16: 190 ms, x2.06 at 32).
CPU = {1: 0.19, 8: 0.21, 16: 0.28, 32: 0.39, 64: 0.78, 128: 1.56, 256: 3.12}


def test_unmeasured_keeps_the_static_cap() -> None:
    assert choose_cap([4, 4], [0.8, 0.8], StepCosts(), 4) == 4


def test_no_draft_measurement_yet_tries_full_depth() -> None:
    c = StepCosts()
    c.observe_verify(1, 0.2)
    assert choose_cap([4], [0.8], c, 4) == 4


def test_single_stream_with_cheap_draft_speculates_deep() -> None:
    c = costs(CPU, {1: 0.01})
    assert choose_cap([6], [0.85], c, 6) >= 4


def test_heavy_load_on_a_linear_verify_turns_speculation_off() -> None:
    c = costs(CPU, {32: 0.12})
    assert choose_cap([4] * 32, [0.8] * 32, c, 4) == 0


def test_low_acceptance_turns_speculation_off() -> None:
    c = costs(CPU, {1: 0.08})
    assert choose_cap([4], [0.05], c, 4) == 0


def test_never_above_what_sequences_want_or_the_static_cap() -> None:
    c = costs({1: 0.1, 64: 0.1}, {1: 0.0001})  # free verify and draft: as deep as allowed
    assert choose_cap([2, 3], [0.99, 0.99], c, 8) == 3
    assert choose_cap([8, 8], [0.99, 0.99], c, 5) == 5


def test_overlapped_draft_is_hidden_behind_verify() -> None:
    c = costs(CPU, {1: 0.05})  # a draft step a quarter of a verify: in sequence, deep drafts cost too much
    assert choose_cap([4], [0.7], c, 4) == 2
    assert choose_cap([4], [0.7], c, 4, overlapped=True) == 4


def test_curve_interpolates_and_extrapolates() -> None:
    c = costs({4: 1.0, 16: 2.0}, {})
    assert c.verify(2) == pytest.approx(1.0)  # flat below the smallest
    assert c.verify(10) == pytest.approx(1.5)  # linear between
    assert c.verify(32) == pytest.approx(4.0)  # linear from the largest, through zero
