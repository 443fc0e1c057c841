"""How many prompt tokens a verify forward may carry, so that the streams decoding beside a long prompt's
prefill keep their pace.

A long prompt is prefilled in chunks, one per verify forward, beside the other sequences' trees (chunked
prefill, `target.TargetVerifier`). Every stream of the replica waits for that forward; on a CPU a forward
costs about its tokens, so a fixed chunk stalls them by whatever it costs on that machine at that context
length (a 64-token chunk: 1.1 s on one AVX-512 core with the 4-bit target, 3.3 s on one AVX2 core in
float32, against rounds of 0.1 and 0.9 s). Here the chunk follows what forwards cost: the replica measures
each (seconds by tokens, `costs.CostCurve`) and gives the next the most tokens predicted to take at most
`factor` times the forward of the other rows alone, the inter-token budget of the streams decoding beside
the prompt. Those rows take their share first (trees, and short prompts' whole catch-ups: the shortest
catch-ups go first, so a short request that comes during a long prefill starts at once), the long prompt's
chunk the rest, within `[LEAST_CHUNK, most]` (`grants`, which the verifier applies: only it knows each
row's catch-up). A forward with no other row, on a replica holding no other sequence, takes `most`: no one
waits on it but a request yet to come.

A size far beyond those measured is priced by extrapolation, which a curve of small decode forwards
gets wrong (their per-token slope is mostly noise): the budget grows at most GROWTH-fold past the
largest forward measured, and measures its way up. Example, factor 1.5, forwards measured at 10 tokens
(0.10 s) and 40 tokens (0.22 s), 4 ms per token: beside trees of 10 tokens (0.10 s) a forward may take
0.15 s, 22 tokens: a prompt chunk of 12.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from speculative.planning.costs import CostCurve

LEAST_CHUNK = 8  # prompt tokens a chunk carries whatever the budget: a long prompt always progresses
GROWTH = 2.0  # a forward's budget is at most this times the largest forward measured
MEMORY = 0.7  # weight an old cost measurement keeps at each new one of its size
MOST_TOKENS = 1 << 20  # a bound for the search: no forward carries more


def grants(
    catch_ups: list[int], trees: list[int], most: int | None, fits: Callable[[int], int] | None, alone: bool
) -> list[int]:
    """The catch-up tokens each row of a forward gets: the shortest catch-ups first, `most` over all rows (None:
    no limit). A row left part-way (a long prompt's chunk) gets at most what `fits(t)` (the most tokens a forward
    may carry beside rows of t tokens: `ChunkBudget.forward_tokens`) leaves beside the rows taken whole (their
    catch-ups and `trees`, roots included), at least LEAST_CHUNK over all such rows; all it can where no row is
    taken whole and the replica holds no other sequence (`alone`), or without `fits`."""
    left = sum(catch_ups) if most is None else most
    out = [0] * len(catch_ups)
    order = sorted(range(len(catch_ups)), key=catch_ups.__getitem__)
    for k in order:
        out[k] = min(catch_ups[k], left)
        left -= out[k]
    partial = [k for k in order if out[k] < catch_ups[k]]
    whole = sum(catch_ups[k] + trees[k] for k in order if out[k] == catch_ups[k])
    if fits is None or not partial or (alone and whole == 0):
        return out
    room = max(fits(whole) - whole, LEAST_CHUNK)
    for k in partial:
        out[k] = min(out[k], room)
        room -= out[k]
    return out


@dataclass
class ChunkBudget:
    """The tokens of each verify forward, from the forwards measured so far."""

    factor: float | None  # a forward carrying a chunk takes at most this times its trees' alone; None: no budget
    curve: CostCurve = field(default_factory=lambda: CostCurve(MEMORY))

    def observe(self, tokens: int, seconds: float) -> None:
        """A forward over `tokens` (trees and chunks, every row) took `seconds`."""
        if tokens > 0:
            self.curve.observe(tokens, seconds)

    def forward_tokens(self, tokens: int) -> int:
        """The most tokens a forward may carry beside rows of `tokens` (their round alone): what is predicted to take
        at most `factor` times their forward (0 before any forward is measured)."""
        assert self.factor is not None, "no budget"
        alone = self.curve(max(tokens, 1))
        if alone is None:
            return 0
        limit = self.factor * alone
        low, high = 0, min(MOST_TOKENS, max(int(GROWTH * self.curve.largest()), 1))
        while low < high:  # the largest size whose predicted seconds fit
            mid = (low + high + 1) // 2
            if (self.curve(mid) or 0.0) <= limit:
                low = mid
            else:
                high = mid - 1
        return low


@dataclass(frozen=True)
class Sizing:
    """What sizes one forward's chunk: the replica's measured costs with their factor, and whether the replica
    holds no sequence beside the call's (`alone`). Sent with each verify call, so every TP rank sizes the same."""

    budget: ChunkBudget
    alone: bool

    def grants(self, catch_ups: list[int], trees: list[int], most: int | None) -> list[int]:
        fits = self.budget.forward_tokens if self.budget.factor is not None else None
        return grants(catch_ups, trees, most, fits, self.alone)
