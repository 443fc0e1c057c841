"""The runner's tree forward equals sequential decoding; commit, rollback and re-prefill are exact."""

from __future__ import annotations

import pytest
import torch

from speculative.drafters.base import Proposal
from speculative.engine import packing
from speculative.engine.batching import ragged_groups
from speculative.engine.runner import ModelRunner, chain_parents
from speculative.rules.sampling import SamplingParams
from speculative.rules.tree import TokenTree
from speculative.target import TargetVerifier, VerifyItem
from tests.tiny_models import ARCHS, full_logits, padded_forward, tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [1, 2, 3, 4, 5]]


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return tiny_model(request.param)


def prefilled(model) -> ModelRunner:
    runner = ModelRunner(model)
    runner.add_rows(["a", "b", "c"])
    runner.extend([p[:-1] for p in PROMPTS])
    return runner


def test_tree_logits_equal_sequential_decoding(model):
    runner = prefilled(model)
    tree = TokenTree(0, (20, 21, 22, 23), (0, 0, 1, 1))  # two children of the root, two of node 1
    tokens = [[p[-1], *tree.tokens] for p in PROMPTS]
    logits = padded_forward(runner, tokens, [tree.runner_parents()] * 3, [list(range(5))] * 3)
    for b, prompt in enumerate(PROMPTS):
        for node in range(tree.size + 1):
            expected = full_logits(model, prompt + tree.path_tokens(node))
            torch.testing.assert_close(logits[b, node], expected, atol=2e-5, rtol=1e-5)


def test_commit_keeps_path_and_rollback_drops_rest(model):
    runner = prefilled(model)
    tree = TokenTree(0, (20, 21, 22), (0, 0, 1))
    runner.forward([[p[-1], *tree.tokens] for p in PROMPTS], [tree.runner_parents()] * 3)
    runner.commit([[0, 1, 3], [0, 2], [0]])  # per row: an accepted path, root first
    assert runner.cached[0] == PROMPTS[0] + [20, 22]
    assert runner.cached[1] == PROMPTS[1] + [21]
    assert runner.cached[2] == PROMPTS[2]
    runner.forward([[30], [31], [32]], [[-1]] * 3, [[0]] * 3)
    runner.commit([[] for _ in runner.rows])  # rollback: nothing kept
    logits = padded_forward(runner, [[40], [41], [42]], [[-1]] * 3, [[0]] * 3)
    for b, full in enumerate([PROMPTS[0] + [20, 22, 40], PROMPTS[1] + [21, 41], PROMPTS[2] + [42]]):
        torch.testing.assert_close(logits[b, 0], full_logits(model, full), atol=2e-5, rtol=1e-5)


def test_rows_join_and_leave(model):
    runner = prefilled(model)
    runner.remove_rows(["b"])
    runner.add_rows(["d"])
    runner.extend([[], [], [1, 2]])
    logits = padded_forward(runner, [[40], [41], [3]], [[-1]] * 3, [[0]] * 3)
    for b, full in enumerate([PROMPTS[0][:-1] + [40], PROMPTS[2][:-1] + [41], [1, 2, 3]]):
        torch.testing.assert_close(logits[b, 0], full_logits(model, full), atol=2e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="pending"):
        runner.add_rows(["e"])
    runner.commit([[] for _ in runner.rows])  # rollback: nothing kept
    with pytest.raises(ValueError, match="already"):
        runner.add_rows(["a"])


def test_sync_cuts_back_diverged_rows(model):
    runner = prefilled(model)
    missing = runner.sync([0, 1], [PROMPTS[0][:3] + [50, 51], PROMPTS[1] + [9]])
    assert missing == [[50, 51], [PROMPTS[1][-1], 9]]
    assert runner.cached[0] == PROMPTS[0][:3]


def test_bad_parents_are_rejected(model):
    runner = prefilled(model)
    with pytest.raises(ValueError, match="earlier column"):
        runner.forward([[1, 2], [], []], [[1, -1], [], []])
    with pytest.raises(ValueError, match="parents"):
        runner.forward([[1, 2], [], []], [[-1], [], []])
    assert chain_parents(3, start=4) == [-1, 4, 5]


def test_verifier_reprefills_a_sequence_it_has_not_seen(model):
    """Soft state: a fresh verifier given a long committed sequence reaches the same verdict."""
    greedy = SamplingParams(temperature=0.0)
    seq = (5, 6, 7, 8, 9, 10, 11, 12)
    tree = TokenTree.chain(seq[-1], [])
    warm = TargetVerifier(ModelRunner(model))
    warm.verify([VerifyItem("s", seq[:4], greedy, Proposal(TokenTree.chain(seq[3], [])))])
    got = warm.verify([VerifyItem("s", seq, greedy, Proposal(tree))])  # cache 3 behind: catch up
    cold = TargetVerifier(ModelRunner(model)).verify([VerifyItem("s", seq, greedy, Proposal(tree))])
    expected = int(full_logits(model, list(seq)).argmax())
    assert got[0].tokens == cold[0].tokens == (expected,)


def test_ragged_groups_split_only_when_padding_costs_more_than_a_call():
    assert ragged_groups([1, 1, 1], overhead=32) == [[0, 1, 2]]
    assert ragged_groups([1, 80, 0, 2], overhead=32) == [[1], [3, 0]]  # idle row 2 left out
    assert ragged_groups([1, 80, 2], overhead=200) == [[1, 2, 0]]  # a forward costs more than the pads
    assert ragged_groups([0, 0], overhead=32) == []


@pytest.mark.parametrize("overhead", [0, 1000])
def test_packed_ragged_rows_equal_each_row_alone(model, overhead, monkeypatch):
    """A long prefill beside short drafts, some rows idle, packed into one row of their tokens and
    attended in groups by length or all together: every row's logits and cache are those of the row
    alone, through several speculative forwards and a commit."""
    monkeypatch.setattr(packing, "ATTENTION_GROUP_OVERHEAD", overhead)
    runner = ModelRunner(model)
    runner.add_rows(["a", "b", "c", "d"])
    runner.extend([p[:-1] for p in PROMPTS] + [[]])  # row d holds nothing yet
    long = list(range(30, 70))
    tokens = [[PROMPTS[0][-1], 20], [], [PROMPTS[2][-1]], long]  # b idle, d prefills 40 tokens
    logits = padded_forward(runner, tokens, [chain_parents(len(t)) for t in tokens], [[0, 1], [], [0], [39]])
    torch.testing.assert_close(logits[0, 0], full_logits(model, PROMPTS[0]), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(logits[0, 1], full_logits(model, PROMPTS[0] + [20]), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(logits[2, 0], full_logits(model, PROMPTS[2]), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(logits[3, 0], full_logits(model, long), atol=2e-5, rtol=1e-5)
    # A second forward before committing: children of earlier speculative columns (0 and 1).
    logits = padded_forward(runner, [[21], [PROMPTS[1][-1]], [], [5]], [[0], [-1], [], [39]], [[0]] * 4)
    torch.testing.assert_close(logits[0, 0], full_logits(model, PROMPTS[0] + [21]), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1, 0], full_logits(model, PROMPTS[1]), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(logits[3, 0], full_logits(model, [*long, 5]), atol=2e-5, rtol=1e-5)
    runner.commit([[0, 1], [40], [0], list(range(40))])  # the first forward took columns 0..39
    assert runner.cached == [PROMPTS[0] + [20], PROMPTS[1], PROMPTS[2], long]
    logits = padded_forward(runner, [[9], [9], [9], [9]], [[-1]] * 4, [[0]] * 4)
    for b, seq in enumerate(runner.cached):
        torch.testing.assert_close(logits[b, 0], full_logits(model, [*seq, 9]), atol=2e-5, rtol=1e-5)


def test_forward_computes_only_the_tokens_given(model):
    """Packed: one row drafting 4 tokens beside three plain decodes puts 8 tokens through the
    layers, not 4 rows padded to 5 (a drafted token costs one token's compute under load)."""
    seen = []
    layer = model.get_output_embeddings()
    first = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding))
    handle = first.register_forward_hook(lambda _m, args, _out: seen.append(tuple(args[0].shape)))
    try:
        runner = ModelRunner(model)
        runner.add_rows(["a", "b", "c", "d"])
        runner.extend([[5, 6], [7], [8, 9, 10], [11]])
        seen.clear()
        tokens = [[1, 2, 3, 4, 5], [6], [7], [8]]
        logits = padded_forward(runner, tokens, [chain_parents(len(t)) for t in tokens], [[4], [0], [0], [0]])
    finally:
        handle.remove()
    assert seen == [(1, 8)]
    assert logits.shape == (4, 1, layer.weight.shape[0])


def test_packed_logits_are_the_asked_ones_row_by_row(model):
    """`forward` returns exactly the logits asked for, rows in order, no pads (the verifier reads
    row b's at the offset of the counts before it)."""
    asks = [[0, 1, 2], [0], [1]]  # row a drafts two tokens, b decodes one, c asks only its second token
    tokens = [[p[-1], 30, 31][: max(a) + 1] for p, a in zip(PROMPTS, asks, strict=True)]
    flat = prefilled(model).forward(tokens, [chain_parents(len(t)) for t in tokens], asks)  # [5, V]
    assert flat is not None and flat.shape[0] == sum(len(a) for a in asks)
    # each is the model's own next-token logits after that row's tokens so far
    after = [PROMPTS[0], [*PROMPTS[0], 30], [*PROMPTS[0], 30, 31], PROMPTS[1], [*PROMPTS[2], 30]]
    for row, context in zip(flat, after, strict=True):
        torch.testing.assert_close(row.float(), full_logits(model, context), atol=1e-4, rtol=1e-4)
