"""Counter-based randomness keyed by (seed, position, stream, index).

Every random decision a request makes is a pure function of its seed and the position of the
token being decided, so a request replayed on another replica, in another batch, or with another
speculation length draws the same numbers. Streams keep independent uses apart: the uniform that
decides acceptance at a position must never be the one that drew the draft token there.
"""

from __future__ import annotations

import enum

import torch

_MASK64 = (1 << 64) - 1


class Stream(enum.IntEnum):
    """Independent random streams of one request."""

    DRAFT = 1  # the draft model sampling its proposals from q
    TARGET = 2  # acceptance tests and samples from the target's p


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int, stream: Stream, index: int = 0) -> float:
    """A uniform float in [0, 1) that depends only on its four keys."""
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (position & _MASK64))
    h = _splitmix64(h ^ (int(stream) << 32 | (index & 0xFFFFFFFF)))
    return (h >> 11) * (1.0 / (1 << 53))


def sample(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample of one token.

    probs: [V] non-negative, not necessarily normalised. Tokens of zero mass are never chosen.
    """
    cdf = probs.double().cumsum(0)  # [V]
    total = float(cdf[-1])
    if not total > 0.0:
        raise ValueError("cannot sample from a distribution with no mass")
    idx = int(torch.searchsorted(cdf, torch.tensor([u * total], dtype=torch.float64), right=True))
    if idx >= probs.numel() or float(probs[idx]) <= 0.0:
        # u * total rounded onto the last boundary: take the last token with mass.
        idx = int(torch.nonzero(probs > 0)[-1])
    return idx


class KeyedDraws:
    """The uniforms of one request for one stream, addressed by (position, index)."""

    __slots__ = ("seed", "stream")

    def __init__(self, seed: int, stream: Stream) -> None:
        self.seed = seed
        self.stream = stream

    def __call__(self, position: int, index: int = 0) -> float:
        return uniform(self.seed, position, self.stream, index)
