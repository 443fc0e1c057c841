"""Which rows of a batch run in one forward: padding to the longest row against a forward's fixed cost.

The runner pads every row of a forward to its longest; a prompt joining beside one-token decodes
would make every row cost a prompt. Splitting into separate forwards costs each one a fixed
overhead (weights read once more: on this CPU a forward of 32 tokens costs about twice one of 1,
MODELS.md). The load control prices rounds by the same positions the runner computes.
"""

from __future__ import annotations

import math

FORWARD_OVERHEAD_TOKENS = 32  # a forward's fixed cost, in tokens' worth of compute (CPU, Qwen 1.5B bf16)


def ragged_groups(lengths: list[int], overhead: int = FORWARD_OVERHEAD_TOKENS) -> list[list[int]]:
    """Rows to run together, so that padding plus per-forward overhead is least.

    A forward over rows g costs about overhead + |g| * max(lengths[g]) tokens' worth (every row is
    padded to the longest). Rows of equal length never gain from a split, and with distinct lengths
    sorted the best split is into runs of neighbours: a small dynamic programme over the distinct
    lengths. Rows with no tokens are left out; one group when nothing is gained. Longest group first,
    longest row first in each.
    """
    sizes = sorted({n for n in lengths if n > 0}, reverse=True)
    count = [sum(1 for n in lengths if n == size) for size in sizes]
    best = [0.0] + [math.inf] * len(sizes)  # best[j]: least cost of the j longest sizes
    cut = [0] * (len(sizes) + 1)
    for j in range(1, len(sizes) + 1):
        rows = 0
        for i in range(j - 1, -1, -1):  # sizes[i:j] in one forward, padded to sizes[i]
            rows += count[i]
            cost = best[i] + overhead + rows * sizes[i]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    spans, j = [], len(sizes)
    while j > 0:
        spans.append(sizes[cut[j] : j])
        j = cut[j]
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    return [[r for r in order if lengths[r] in span] for span in spans[::-1]]


def padded_tokens(lengths: list[int], overhead: int = FORWARD_OVERHEAD_TOKENS) -> int:
    """What the runner's forwards over rows of these lengths cost, in tokens' worth: the positions it
    computes (padding included) and the fixed overhead of each forward beyond the first."""
    groups = ragged_groups(lengths, overhead)
    return sum(len(g) * lengths[g[0]] for g in groups) + overhead * max(len(groups) - 1, 0)  # g[0]: longest
