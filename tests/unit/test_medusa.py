"""Medusa heads: the published checkpoint layout, trees from choices, and exact output with random heads."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from speculative.decoder import SpeculativeDecoder
from speculative.drafters.base import DraftRequest
from speculative.drafters.heads import HeadInput, NextTree, TreeDrafter, cut
from speculative.drafters.medusa import (
    DEFAULT_CHOICES,
    MedusaHeads,
    MedusaTrees,
    check_choices,
    choices_tree,
    load_medusa,
    save_medusa,
)
from speculative.engine.runner import ModelRunner
from speculative.planning.depth import DepthConfig
from speculative.rules.sampling import SamplingParams
from speculative.rules.tree import TokenTree
from speculative.target import TargetVerifier
from tests.tiny_models import VOCAB, heads_for, joined_mid_stream, reference_greedy, tiny_model

NEW = 24
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [11, 12], [20, 21, 22, 23, 24, 25, 26, 20, 21, 22], [7]]
CHAIN = ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW)


def decoder(target, heads: MedusaHeads | None, choices=DEFAULT_CHOICES, max_depth: int = 4) -> SpeculativeDecoder:
    verifier = TargetVerifier(ModelRunner(target), heads=MedusaTrees(heads, choices) if heads is not None else None)
    drafter = TreeDrafter(verifier.drafted) if heads is not None else None
    return SpeculativeDecoder(verifier, drafter, DepthConfig(max_depth=max_depth, adaptive=False))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def models(request):
    target = tiny_model(request.param)
    return target, heads_for(target), [reference_greedy(target, p, NEW) for p in PROMPTS]


def test_published_layout_round_trip(tmp_path):
    heads = MedusaHeads(hidden=16, vocab=32, heads=3, layers=2)
    folder = save_medusa(heads, tmp_path / "medusa", base_model="tiny")
    keys = set(heads.medusa_head.state_dict())
    assert "0.0.linear.weight" in keys and "0.1.linear.bias" in keys and "2.2.weight" in keys  # FasterDecoding's names
    loaded = load_medusa(folder)
    x = torch.randn(5, 16)
    assert loaded.heads == 3 and loaded.layers == 2
    torch.testing.assert_close(loaded(x), heads(x))
    assert loaded(x).shape == (5, 3, 32)


def test_loads_a_pt_checkpoint_with_prefixed_keys(tmp_path):
    """Some trainers save the whole module (`medusa_head.` prefix) as medusa_lm_head.pt."""
    heads = MedusaHeads(hidden=8, vocab=12, heads=2)
    (tmp_path / "config.json").write_text('{"medusa_num_heads": 2, "medusa_num_layers": 1}')
    torch.save(
        {f"medusa_head.{k}": v for k, v in heads.medusa_head.state_dict().items()}, tmp_path / "medusa_lm_head.pt"
    )
    x = torch.randn(3, 8)
    torch.testing.assert_close(load_medusa(tmp_path)(x), heads(x))
    (tmp_path / "medusa_lm_head.pt").unlink()
    with pytest.raises(FileNotFoundError, match="medusa_lm_head"):
        load_medusa(tmp_path)
    save_file(
        {k: v.contiguous() for k, v in heads.medusa_head.state_dict().items()}, tmp_path / "medusa_lm_head.safetensors"
    )
    torch.testing.assert_close(load_medusa(tmp_path)(x), heads(x))


def test_tree_from_choices():
    top = [[5, 9], [7, 3]]
    tree = choices_tree(1, top, check_choices([(0,), (1,), (0, 0)], 2), depth=4)
    assert (tree.tokens, tree.parents) == ((5, 9, 7), (0, 0, 1))
    shallow = choices_tree(1, top, check_choices([(0,), (1,), (0, 0)], 2), depth=1)
    assert shallow.tokens == (5, 9)
    assert choices_tree(1, top, check_choices([(0,), (0, 5)], 2), depth=4).tokens == (5,)  # rank past top: left out
    with pytest.raises(ValueError, match="prefix"):
        check_choices([(0, 0)], 2)
    with pytest.raises(ValueError, match="one per head"):
        check_choices([(0,), (0, 0), (0, 0, 0)], 2)


def test_drafter_proposes_only_for_the_length_it_drafted_at():
    trees = {"a": NextTree(3, TokenTree(3, (4, 6, 8), (0, 1, 0)))}
    drafter = TreeDrafter(trees)
    fresh, shallow, stale, unknown = drafter.propose(
        [
            DraftRequest("a", (1, 2, 3), 4, GREEDY),
            DraftRequest("a", (1, 2, 3), 1, GREEDY),
            DraftRequest("a", (1, 2, 3, 4), 4, GREEDY),
            DraftRequest("b", (1,), 4, GREEDY),
        ]
    )
    assert fresh.tree.tokens == (4, 6, 8) and stale.tree.size == 0 and unknown.tree.size == 0
    assert (shallow.tree.tokens, shallow.tree.parents) == ((4, 8), (0, 0))  # cut to the round's depth
    drafter.release(["a"])
    assert drafter.cached_sequences() == 0


def test_cut_keeps_a_tree():
    tree = TokenTree(1, (2, 3, 4, 5, 6), (0, 1, 0, 2, 3))  # depths 1, 2, 1, 3, 2
    shallow = cut(tree, 2)
    assert (shallow.tokens, shallow.parents) == ((2, 3, 4, 6), (0, 1, 0, 3))
    assert cut(tree, 3, nodes=2).tokens == (2, 3) and cut(tree, 0).size == 0


def test_medusa_trees_read_the_bonus_tokens_state():
    """The heads read the hidden state the bonus came from (the last kept), and only when it is there."""
    heads = MedusaHeads(hidden=8, vocab=12, heads=2)
    medusa = MedusaTrees(heads, CHAIN[:2], top=1)
    features = torch.randn(3, 8)
    (tree,) = medusa.advance([HeadInput("a", (1, 2, 3, 4), 0, features, draft=True)])
    assert tree is not None and tree.root == 4
    assert list(tree.tokens) == [int(t) for t in heads.top(features[-1:], 1)[0, :, 0]]
    missing = HeadInput("a", (1, 2, 3, 4, 5), 0, features, draft=True)
    prefilling = HeadInput("a", (1, 2, 3, 4), 0, features, draft=False)
    assert medusa.advance([missing, prefilling]) == [None, None]  # the bonus's state missing; still prefilling


@pytest.mark.parametrize("choices", [CHAIN, DEFAULT_CHOICES], ids=["chain", "tree"])
def test_greedy_identical_to_the_target_alone(models, choices):
    target, heads, refs = models
    for prompt, ref in zip(PROMPTS, refs, strict=True):
        (out,) = decoder(target, heads, choices).generate([prompt], GREEDY)
        assert out.output == ref
    outs = decoder(target, heads, choices).generate(PROMPTS, GREEDY)  # a mixed batch
    assert [o.output for o in outs] == refs
    assert sum(o.stats.accepted for o in outs) > 0  # the heads' guesses are sometimes right


def test_sequences_joining_mid_stream_stay_exact(models):
    target, heads, refs = models
    dec = decoder(target, heads)
    assert joined_mid_stream(dec, PROMPTS, GREEDY) == refs
    assert not dec.target.drafted  # finished sequences' trees are released


def test_seeded_sampling_gives_plain_sampling_output(models):
    """Medusa trees are deterministic drafts: target-sample matching emits what plain sampling emits."""
    target, heads, _ = models
    sampled = [SamplingParams(temperature=0.9, top_k=40, max_tokens=NEW, seed=s) for s in (1, 2, 3, 4)]
    plain = [o.output for o in decoder(target, None).generate(PROMPTS, sampled)]
    assert [o.output for o in decoder(target, heads).generate(PROMPTS, sampled)] == plain


def test_vocab_matches_the_target(models):
    target, heads, _ = models
    assert heads.vocab == VOCAB == ModelRunner(target).vocab_size
