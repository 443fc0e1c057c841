"""The lean stack (`speculative/engine/lean_stack.py`) computes what the model's own stack computes, bit for bit."""

from __future__ import annotations

import pytest
import torch

from speculative.engine.lean_stack import lean_stack
from speculative.engine.runner import ModelRunner, chain_parents
from speculative.rules.tree import TokenTree
from tests.tiny_models import padded_forward, tiny_config, tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [1, 2, 3, 4, 5]]


def _session(runner: ModelRunner) -> list[torch.Tensor]:
    """Logits of a prefill of three ragged rows, a tree verified in every row, a commit, then a ragged forward
    (rows of one token beside a row of three, a draft round under load) and a rollback."""
    out = []
    runner.add_rows(["a", "b", "c"])
    chains, lasts = [chain_parents(len(p)) for p in PROMPTS], [[len(p) - 1] for p in PROMPTS]
    out.append(padded_forward(runner, PROMPTS, chains, lasts))
    runner.commit([list(range(len(p))) for p in PROMPTS])
    tree = TokenTree(0, (20, 21, 22, 23), (0, 0, 1, 1))
    tokens = [[9, *tree.tokens]] * 3
    out.append(padded_forward(runner, tokens, [tree.runner_parents()] * 3, [list(range(5))] * 3))
    runner.commit([[0, 1, 3], [0, 2], [0]])
    ragged = [[30], [31, 32, 33], [34]]
    out.append(padded_forward(runner, ragged, [[-1], chain_parents(3), [-1]], [[0], [0, 1, 2], [0]]))
    runner.commit([[] for _ in runner.rows])
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lean_logits_equal_the_models_own(arch):
    model = tiny_model(arch)
    lean = ModelRunner(model, lean=True)
    assert lean._lean is not None  # the architecture is known: the lean stack runs
    for got, want in zip(_session(lean), _session(ModelRunner(model)), strict=True):
        assert torch.equal(got, want)


def test_unknown_stacks_keep_the_models_own():
    assert lean_stack(tiny_model("gpt2").base_model) is None  # another architecture
    config = tiny_config("qwen2")
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 4, 0
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    sliding = type(tiny_model("qwen2"))(config).eval()
    assert lean_stack(sliding.base_model) is None  # a window the loop does not apply
    assert ModelRunner(sliding, lean=True)._lean is None
