"""Which rows of a packed forward attend together: padding queries to the longest row against a call's cost.

The runner packs every row's new tokens into one row (`packing`), so projections and MLPs compute
exactly the tokens given; only attention works per row, on queries padded to the longest row of
the call. A prompt attended beside one-token decodes would pad every decode to a prompt's length,
while each extra call (per layer) has a fixed cost: rows are grouped to make the sum least.
"""

from __future__ import annotations

import math


def ragged_groups(lengths: list[int], overhead: int) -> list[list[int]]:
    """Rows to run together, so that padding plus per-call overhead is least.

    A call over rows g costs about overhead + |g| * max(lengths[g]) tokens' worth (every row is
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
