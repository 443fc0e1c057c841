"""The counter-based generator: keyed, uniform, streams independent; inverse-CDF sampling exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from speculative.rules.rng import KeyedDraws, Stream, sample, uniform

N = 100_000
ALPHA = 1e-4  # each statistical assertion fails falsely with probability 1e-4; seeds are fixed

seeds = st.integers(0, 2**63 - 1)
positions = st.integers(0, 2**40)
indices = st.integers(0, 2**32 - 1)
streams = st.sampled_from(list(Stream))


@given(seeds, positions, streams, indices)
def test_uniform_is_a_function_of_its_keys(seed: int, position: int, stream: Stream, index: int) -> None:
    u = uniform(seed, position, stream, index)
    assert 0.0 <= u < 1.0
    assert uniform(seed, position, stream, index) == u
    assert KeyedDraws(seed, stream)(position, index) == u


@given(seeds, positions, streams, indices)
def test_changing_any_key_changes_the_draw(seed: int, position: int, stream: Stream, index: int) -> None:
    u = uniform(seed, position, stream, index)
    other_stream = Stream.TARGET if stream == Stream.DRAFT else Stream.DRAFT
    variants = [
        uniform(seed ^ 1, position, stream, index),
        uniform(seed, position + 1, stream, index),
        uniform(seed, position, other_stream, index),
        uniform(seed, position, stream, index ^ 1),
    ]
    # 53-bit outputs: a collision by chance has probability ~1e-16 per pair
    assert all(v != u for v in variants)
    assert len(set(variants)) == len(variants)


def test_default_index_is_zero() -> None:
    assert uniform(3, 5, Stream.TARGET) == uniform(3, 5, Stream.TARGET, 0)
    assert KeyedDraws(3, Stream.TARGET)(5) == uniform(3, 5, Stream.TARGET, 0)


def _draws(vary: str, stream: Stream = Stream.TARGET) -> np.ndarray:
    """N draws with one key running over 0..N-1 and the others fixed."""
    keys = {"seed": 12345, "position": 17, "index": 2}
    out = np.empty(N)
    for i in range(N):
        keys[vary] = i
        out[i] = uniform(keys["seed"], keys["position"], stream, keys["index"])
    return out


@pytest.mark.parametrize("vary", ["seed", "position", "index"])
def test_draws_are_uniform(vary: str) -> None:
    x = _draws(vary)
    assert x.min() >= 0.0 and x.max() < 1.0
    assert stats.kstest(x, "uniform").pvalue > ALPHA
    # and successive draws are not correlated (what a sequence of positions or children sees)
    assert abs(np.corrcoef(x[:-1], x[1:])[0, 1]) < 4.5 / np.sqrt(N)


@pytest.mark.parametrize("vary", ["seed", "position", "index"])
def test_streams_are_independent(vary: str) -> None:
    """Draft and target draws under the same (seed, position, index) are unrelated."""
    draft, target = _draws(vary, Stream.DRAFT), _draws(vary, Stream.TARGET)
    # Pearson r of independent uniforms is ~ N(0, 1/N): 4.5 sigma is a 7e-6 false-failure rate.
    assert abs(np.corrcoef(draft, target)[0, 1]) < 4.5 / np.sqrt(N)
    # Beyond linear correlation: the 10 x 10 joint histogram is the product of its margins.
    joint, _, _ = np.histogram2d(draft, target, bins=10, range=[[0, 1], [0, 1]])
    assert stats.chi2_contingency(joint).pvalue > ALPHA


# ---- sample ------------------------------------------------------------------------------------

probs_lists = st.lists(
    st.one_of(st.just(0.0), st.floats(1e-30, 1e30, allow_nan=False, allow_infinity=False)), min_size=1, max_size=12
).filter(lambda ps: any(p > 0 for p in ps))
edge_uniforms = st.one_of(st.floats(0.0, 1.0, exclude_max=True), st.sampled_from([0.0, 1.0 - 2**-53, 0.5]))


@settings(max_examples=500)
@given(probs_lists, edge_uniforms)
def test_sample_never_returns_a_zero_probability_token(probs: list[float], u: float) -> None:
    for dtype in (torch.float32, torch.float64):
        tensor = torch.tensor(probs, dtype=dtype)
        if not float(tensor.sum()) > 0 or not torch.isfinite(tensor.double().sum()):
            continue  # float32 underflow to all-zero / overflow
        idx = sample(tensor, u)
        assert 0 <= idx < len(probs)
        assert float(tensor[idx]) > 0.0


def test_sample_boundaries() -> None:
    assert sample(torch.tensor([0.0, 0.0, 1.0]), 0.0) == 2
    assert sample(torch.tensor([0.5, 0.5, 0.0]), 1.0 - 2**-53) == 1
    assert sample(torch.tensor([0.25, 0.0, 0.75]), 0.25) == 2  # a boundary goes to the next token with mass
    assert sample(torch.tensor([2.0, 6.0]), 0.2499) == 0  # unnormalised: mass 2 of 8
    assert sample(torch.tensor([2.0, 6.0]), 0.25) == 1
    with pytest.raises(ValueError, match="no mass"):
        sample(torch.zeros(4), 0.5)


def test_sample_is_an_exact_inverse_cdf() -> None:
    """On a fine grid of u, each token takes a share of the grid equal to its probability."""
    probs = torch.tensor([0.1, 0.0, 0.25, 0.05, 0.0, 0.6])  # [6]
    m = 20_000
    hits = np.bincount([sample(probs, (k + 0.5) / m) for k in range(m)], minlength=6)
    np.testing.assert_allclose(hits / m, probs.numpy(), atol=1.5 / m)


def test_sample_matches_the_distribution() -> None:
    """Keyed uniforms through sample() are distributed as probs (chi-square over N draws)."""
    probs = torch.tensor([0.3, 0.0, 0.2, 0.1, 0.25, 0.0, 0.1, 0.05])  # [8], two impossible tokens
    counts = np.bincount([sample(probs, uniform(99, i, Stream.TARGET)) for i in range(N)], minlength=8)
    possible = probs.numpy() > 0
    assert counts[~possible].sum() == 0
    expected = N * probs.numpy()[possible].astype(np.float64)
    assert stats.chisquare(counts[possible], expected * counts.sum() / expected.sum()).pvalue > ALPHA
