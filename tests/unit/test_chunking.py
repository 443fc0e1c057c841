"""A long prompt's chunk sized to the inter-token budget of the rows beside it (`speculative/planning/
chunking.py`), on forwards whose cost is known: a fixed part plus a part per token, as a CPU's."""

from __future__ import annotations

import itertools

from speculative.planning.chunking import LEAST_CHUNK, ChunkBudget, grants


def cost(tokens: int) -> float:
    return 0.05 + 0.004 * tokens  # seconds: 50 ms a forward plus 4 ms a token


def test_the_forward_grows_from_what_was_measured_to_the_factor_and_no_faster_than_doubling() -> None:
    budget = ChunkBudget(factor=3.0)
    trees = 10  # a decoding row's tree beside the long prompt: 0.09 s alone
    assert budget.forward_tokens(trees) == 0, "nothing measured yet"
    assert grants([0, 4000], [trees, 1], 256, budget.forward_tokens, False) == [0, LEAST_CHUNK], "the least chunk"
    for _ in range(3):  # decode forwards only
        budget.observe(trees, cost(trees))
    sizes = []
    for _ in range(12):
        _, chunk = grants([0, 4000], [trees, 1], 256, budget.forward_tokens, False)
        sizes.append(chunk + trees)
        budget.observe(chunk + trees, cost(chunk + trees))
    fits = (3 * cost(trees) - 0.05) / 0.004  # 55 tokens take 0.27 s
    assert sizes[0] <= 2 * trees, "past the forwards measured, at most twice the largest"
    assert all(b <= 2 * a for a, b in itertools.pairwise(sizes)), sizes
    assert fits - 3 <= sizes[-1] <= fits, sizes
    assert all(cost(s) <= 3 * cost(trees) + 1e-9 for s in sizes), "no forward past the budget"


def test_the_shortest_catch_ups_go_first_and_the_long_prompt_gets_what_the_budget_leaves() -> None:
    budget = ChunkBudget(factor=2.0)
    for tokens in (10, 20, 40, 60, 80):
        budget.observe(tokens, cost(tokens))
    fits = budget.forward_tokens
    assert fits(20) == 52, "2 x 0.13 s"
    # a decoding row (tree of 8) and a short prompt (11 + root) taken whole: 20 tokens; the long prompt gets 32
    assert grants([4000, 0, 11], [1, 8, 1], 64, fits, False) == [32, 0, 11]
    assert grants([4000, 0, 11], [1, 8, 1], 16, fits, False) == [5, 0, 11], "never past prefill_chunk_tokens"
    assert grants([4000, 0, 50], [1, 8, 1], 64, fits, False) == [14, 0, 50], "what the cap leaves"
    tight = ChunkBudget(factor=1.0, curve=budget.curve)  # beside the other rows, nothing fits
    assert grants([4000, 0, 11], [1, 8, 1], 64, tight.forward_tokens, False) == [LEAST_CHUNK, 0, 11], "it progresses"
    assert grants([4000, 3000], [1, 1], 64, fits, True) == [0, 64], "two long prompts: the shorter first"
    assert grants([30, 4000], [1, 1], None, None, False) == [30, 4000], "no limit, no budget"


def test_a_forward_no_one_waits_on_takes_the_whole_chunk() -> None:
    budget = ChunkBudget(factor=2.0)
    budget.observe(10, cost(10))
    assert grants([4000], [1], 64, budget.forward_tokens, alone=True) == [64], "no other row, no other sequence"
    assert grants([4000], [1], 64, budget.forward_tokens, alone=False) == [20], "a sequence waits elsewhere"
    assert grants([4000, 0], [1, 10], 64, budget.forward_tokens, alone=True) == [10, 0], "a row decodes beside it"
    assert grants([4000, 0], [1, 10], 64, None, alone=False) == [64, 0], "no budget: prefill_chunk_tokens"
