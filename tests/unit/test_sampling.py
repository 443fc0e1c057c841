"""The sampling transforms equal Hugging Face's own logits processors; SamplingParams bounds."""

from __future__ import annotations

import itertools
from typing import cast

import pytest
import torch
from pydantic import ValidationError
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from speculative.rules.sampling import SamplingParams, apply_repetition_penalty, context_seen, probs_from_logits

ROWS, VOCAB, CONTEXT = 16, 50, 12


def _batch(seed: int, ties: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random logits [ROWS, VOCAB], contexts [ROWS, CONTEXT] and their seen masks [ROWS, VOCAB]."""
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(ROWS, VOCAB, generator=g)
    if ties:  # exact zeros, and rows of tied values
        logits[0, :5] = 0.0
        logits[1:4] = logits[1:4].round()
    input_ids = torch.randint(0, VOCAB, (ROWS, CONTEXT), generator=g)
    seen = torch.zeros(ROWS, VOCAB, dtype=torch.bool).scatter(1, input_ids, True)
    return logits, input_ids, seen


def _hf_probs(logits: torch.Tensor, input_ids: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What HF `generate` does with these settings: its processors in its order, then softmax."""
    processors = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    processors.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k > 0:
        processors.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        processors.append(TopPLogitsWarper(params.top_p))
    return processors(cast(torch.LongTensor, input_ids), logits.clone()).softmax(-1)


GRID = list(
    itertools.product(
        [0.3, 1.0, 1.7],  # temperature
        [0, 1, 5, VOCAB + 10],  # top_k (0 and >= vocab keep all)
        [1.0, 0.95, 0.5, 0.05],  # top_p
        [1.0, 1.3, 0.7],  # repetition penalty (< 1 rewards repeats)
    )
)


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "penalty"), GRID)
def test_probs_equal_hf_processors(temperature: float, top_k: int, top_p: float, penalty: float) -> None:
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=penalty)
    for seed in range(3):
        logits, input_ids, seen = _batch(seed)
        ours = probs_from_logits(apply_repetition_penalty(logits, seen, penalty), params)
        theirs = _hf_probs(logits, input_ids, params)
        assert ours.dtype == torch.float32 and ours.shape == (ROWS, VOCAB)
        assert torch.equal(ours > 0, theirs > 0), "kept a different set of tokens"
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(ours.sum(-1), torch.ones(ROWS))


@pytest.mark.parametrize("params", [SamplingParams(top_p=0.9), SamplingParams(top_k=7, top_p=0.7)])
def test_ties_at_the_cut_keep_as_many_tokens_as_hf(params: SamplingParams) -> None:
    """Which of several tied tokens survive a cut depends on sort order (ours and HF's differ);
    how many survive, and the distribution up to relabelling the tied tokens, do not."""
    for seed in range(3):
        logits, input_ids, _ = _batch(seed, ties=True)
        ours, theirs = probs_from_logits(logits, params), _hf_probs(logits, input_ids, params)
        torch.testing.assert_close(ours.sort(-1).values, theirs.sort(-1).values, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.5, 3.0])
def test_repetition_penalty_equals_hf_exactly(penalty: float) -> None:
    logits, input_ids, seen = _batch(7, ties=True)
    ours = apply_repetition_penalty(logits, seen, penalty)
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits.clone())
    assert torch.equal(ours, theirs)


def test_repetition_penalty_direction_and_unseen_tokens() -> None:
    logits = torch.tensor([[2.0, -2.0, 0.0, 4.0]])  # [1, 4]
    seen = torch.tensor([[True, True, True, False]])
    out = apply_repetition_penalty(logits, seen, 2.0)
    assert out.tolist() == [[1.0, -4.0, 0.0, 4.0]]  # positive halved, negative doubled, unseen kept
    assert apply_repetition_penalty(logits, seen, 1.0) is logits


def test_context_seen_marks_context_and_each_rows_path() -> None:
    seen = context_seen([1, 1, 4], [[], [2], [2, 3]], 6)  # [3, 6]
    assert seen.tolist() == [
        [False, True, False, False, True, False],
        [False, True, True, False, True, False],
        [False, True, True, True, True, False],
    ]


def test_greedy_is_one_hot_argmax() -> None:
    logits, _, _ = _batch(3)
    # top-k / top-p are irrelevant under greedy
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, top_k=3, top_p=0.5)):
        probs = probs_from_logits(logits, params)
        assert params.greedy
        assert probs.dtype == torch.float32
        assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), VOCAB).float())


def test_top_k_one_is_argmax_at_any_temperature() -> None:
    logits, _, _ = _batch(4)
    probs = probs_from_logits(logits, SamplingParams(temperature=1.7, top_k=1))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.max(-1).values, torch.ones(ROWS))


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])  # [1, 4]
    kept = probs_from_logits(probs.log(), SamplingParams(top_p=0.8)) > 0
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 + 0.3 reaches 0.8
    kept = probs_from_logits(probs.log(), SamplingParams(top_p=0.81)) > 0
    assert kept.tolist() == [[True, True, True, False]]
    kept = probs_from_logits(probs.log(), SamplingParams(top_p=0.01)) > 0
    assert kept.tolist() == [[True, False, False, False]]  # the best token is always kept


# ---- SamplingParams bounds ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1.0),
        ("temperature", 101.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("max_tokens", 0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("seed", -1),
        ("stop", ("",)),
        ("stop", ("end", "")),
        ("stop_token_ids", (3, -1)),
        ("unknown_field", 1),
    ],
)
def test_out_of_range_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as info:
        SamplingParams(**{field: value})
    errors = info.value.errors()
    assert errors, "no error reported"
    # A field error names it in `loc`; the cross-field validator names it in its message.
    assert any(field in err["loc"] or err["msg"].startswith(f"Value error, {field}:") for err in errors), errors
    assert field in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": 100.0},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": 0},
        {"max_tokens": 1},
        {"repetition_penalty": 10.0},
        {"stop": ("a",) * 16},
        {"stop_token_ids": (0,)},
        {"seed": 2**63 - 1},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict[str, object]) -> None:
    SamplingParams(**kwargs)


def test_params_are_frozen_and_reject_wrong_types() -> None:
    params = SamplingParams()
    with pytest.raises(ValidationError):
        params.temperature = 0.5  # type: ignore[misc]
    with pytest.raises(ValidationError, match="top_k"):
        SamplingParams(top_k="many")  # type: ignore[arg-type]
