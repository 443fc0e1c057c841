"""The runner's slot cache: written in place, no per-step allocation, commit by index, exact."""

from __future__ import annotations

import pytest
import torch

from speculative.engine.kv_cache import BUCKET, SlotCache
from speculative.engine.runner import ModelRunner, chain_parents
from tests.tiny_models import ARCHS, full_logits, padded_forward, tiny_model


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return tiny_model(request.param)


def buffers(runner: ModelRunner) -> list[tuple[int, tuple[int, ...]]]:
    """(address, shape) of every layer's key and value buffer."""
    stores = (runner.cache.keys, runner.cache.values)
    return [(b.data_ptr(), tuple(b.shape)) for s in stores for b in s.values()]


def test_decode_steps_write_in_place(model):
    """Once reserved, decode and verify steps allocate no cache memory: same buffers, same bytes."""
    runner = ModelRunner(model)
    runner.cache.reserve(4, 256)
    runner.add_rows(["a", "b", "c", "d"])
    runner.extend([[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]])
    before, size = buffers(runner), runner.cache.nbytes()
    assert size > 0 and all(shape[:2] == (4, 256) for _, shape in before)
    for step in range(40):
        tokens = [[11 + step, 12, 13], [14], [15, 16], [17]]
        runner.forward(tokens, [chain_parents(len(t)) for t in tokens], [list(range(len(t))) for t in tokens])
        runner.commit([[0, 1], [0], [0], []])  # accepted prefixes of chains, and a row that keeps nothing
    assert buffers(runner) == before and runner.cache.nbytes() == size


def test_chain_commits_move_nothing_and_side_branches_move(model, monkeypatch):
    moved: list[list[int]] = []
    original = SlotCache.move_columns

    def spy(self, rows, src, dst):
        moved.append(src.tolist())
        original(self, rows, src, dst)

    monkeypatch.setattr(SlotCache, "move_columns", spy)
    runner = ModelRunner(model)
    runner.add_rows(["a"])
    prompt = [3, 1, 4, 1, 5]
    runner.extend([prompt])
    runner.forward([[9, 2, 6]], [chain_parents(3)])
    runner.commit([[0, 1]])  # a chain's accepted prefix: already in place
    assert moved == []
    # a tree: root 7 with children 8 (column 1) and 9 (column 2); 9's child 10 (column 3)
    runner.forward([[7, 8, 9, 10]], [[-1, 0, 0, 2]])
    runner.commit([[0, 2, 3]])  # root, then the second child and its child: two columns move
    base = len(prompt) + 2
    assert moved == [[base + 2, base + 3]]
    assert runner.cached[0] == [*prompt, 9, 2, 7, 9, 10]
    logits = padded_forward(runner, [[11]], [[-1]], [[0]])
    assert logits is not None
    torch.testing.assert_close(logits[0, 0], full_logits(model, [*prompt, 9, 2, 7, 9, 10, 11]), atol=2e-5, rtol=1e-5)


def test_removed_rows_leave_the_others_exact(model):
    """Removing rows moves the last rows into the holes; every row left continues exactly."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]
    runner = ModelRunner(model)
    runner.add_rows(["a", "b", "c", "d", "e"])
    runner.extend(prompts)
    runner.remove_rows(["b", "e"])  # a hole below the new size (b), and the last row
    assert sorted(runner.rows) == ["a", "c", "d"] and len(runner.rows) == 3
    runner.add_rows(["f"])
    runner.extend([[] if s != "f" else [1, 2] for s in runner.rows])
    by_id = {"a": prompts[0], "c": prompts[2], "d": prompts[3], "f": [1, 2]}
    tokens = [[40 + i] for i in range(len(runner.rows))]
    logits = padded_forward(runner, tokens, [[-1]] * len(tokens), [[0]] * len(tokens))
    assert logits is not None
    for b, seq_id in enumerate(runner.rows):
        expected = full_logits(model, [*by_id[seq_id], 40 + b])
        torch.testing.assert_close(logits[b, 0], expected, atol=2e-5, rtol=1e-5)


def test_growth_past_capacity_keeps_the_cache(model):
    """A row outgrowing the buffers doubles them (a copy, not a per-step cost) and stays exact."""
    runner = ModelRunner(model)
    runner.add_rows(["a", "b"])
    first = list(range(3, 3 + BUCKET - 4))
    runner.extend([first, [7, 8]])
    capacity = runner.cache.capacity
    longer = [3 + i % 90 for i in range(3 * capacity)]
    runner.extend([longer, []])
    assert runner.cache.capacity >= 2 * capacity
    logits = padded_forward(runner, [[5], [9]], [[-1], [-1]], [[0], [0]])
    assert logits is not None
    torch.testing.assert_close(logits[0, 0], full_logits(model, [*first, *longer, 5]), atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1, 0], full_logits(model, [7, 8, 9]), atol=2e-5, rtol=1e-5)
