"""EAGLE: the published checkpoint layout, the head's cache and tree attention, the dynamic tree, and exact
output with random heads on tiny Llama and Qwen2 targets."""

from __future__ import annotations

import pytest
import torch

from speculative.decoder import SpeculativeDecoder
from speculative.drafters.eagle import EagleModel, EagleShape, EagleTrees, confidence_tree, load_eagle, save_eagle
from speculative.drafters.heads import TreeDrafter
from speculative.engine.runner import ModelRunner
from speculative.planning.depth import DepthConfig
from speculative.rules.sampling import SamplingParams
from speculative.target import TargetVerifier
from tests.tiny_models import eagle_for, joined_mid_stream, reference_greedy, tiny_model

NEW = 24
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [11, 12], [20, 21, 22, 23, 24, 25, 26, 20, 21, 22], [7]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW)
SHAPE = EagleShape(hidden=16, heads=4, kv_heads=2, intermediate=32, vocab=24, qkv_bias=True)


def trees_for(target, head: EagleModel, top_k: int = 3, depth: int = 4, nodes: int = 10) -> EagleTrees:
    runner_head = target.get_output_embeddings()
    return EagleTrees(head, target.get_input_embeddings(), runner_head, top_k, depth, nodes)


def decoder(target, head: EagleModel | None, chunk: int | None = None, **tree) -> SpeculativeDecoder:
    heads = trees_for(target, head, **tree) if head is not None else None
    verifier = TargetVerifier(ModelRunner(target), prefill_chunk=chunk, heads=heads)
    drafter = TreeDrafter(verifier.drafted) if head is not None else None
    return SpeculativeDecoder(verifier, drafter, DepthConfig(max_depth=5, adaptive=False))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def models(request):
    target = tiny_model(request.param)
    return target, eagle_for(target), [reference_greedy(target, p, NEW) for p in PROMPTS]


def test_published_layout_round_trip(tmp_path):
    head = EagleModel(EagleShape(**{**SHAPE.__dict__, "layers": 2}))
    folder = save_eagle(head, tmp_path / "eagle", base_model="tiny")
    keys = set(head.state_dict())
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.bias", "layers.0.mlp.gate_proj.weight"} <= keys
    assert "layers.0.post_attention_layernorm.weight" in keys and "layers.1.input_layernorm.weight" in keys
    assert "layers.0.input_layernorm.weight" not in keys  # EAGLE's first layer reads fc's output as it is
    config = (folder / "config.json").read_text()
    assert '"qkv_bias": true' in config and '"num_hidden_layers": 2' in config
    loaded = load_eagle(folder)
    args = _inputs(head, 5)
    torch.testing.assert_close(loaded(*args)[0], head(*args)[0])


def test_loads_pytorch_model_bin_with_the_targets_embedding(tmp_path):
    """EAGLE's own checkpoints are pytorch_model.bin, often with a copy of the target's embedding."""
    head = EagleModel(SHAPE)
    save_eagle(head, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"pytorch_model\.bin"):
        load_eagle(tmp_path)
    torch.save({**head.state_dict(), "embed_tokens.weight": torch.randn(24, 16)}, tmp_path / "pytorch_model.bin")
    args = _inputs(head, 3)
    torch.testing.assert_close(load_eagle(tmp_path)(*args)[0], head(*args)[0])


def _inputs(head: EagleModel, n: int, past: int = 0):
    mask = torch.ones(n, past + n, dtype=torch.bool).tril(past)
    return torch.randn(n, 16), torch.randn(n, 16), torch.arange(past, past + n), head.empty_cache(), mask


def test_cache_and_tree_attention_match_a_chain():
    """Pairs fed one at a time through the cache give what one forward gives, and a tree node's guess is the
    one a chain along its path would give (the tree mask and positions are the chain's)."""
    torch.manual_seed(0)
    head = EagleModel(SHAPE).eval()
    emb, feat = torch.randn(6, 16), torch.randn(6, 16)
    whole, _ = head(emb, feat, torch.arange(6), head.empty_cache(), torch.ones(6, 6, dtype=torch.bool).tril())
    cache, outs = head.empty_cache(), []
    for t in range(6):
        out, kv = head(
            emb[t : t + 1], feat[t : t + 1], torch.tensor([t]), cache, torch.ones(1, t + 1, dtype=torch.bool)
        )
        cache = [(torch.cat([k0, k], 1), torch.cat([v0, v], 1)) for (k0, v0), (k, v) in zip(cache, kv, strict=True)]
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs), whole, atol=1e-5, rtol=1e-5)
    # two siblings then a child of the second, fed together after the 6 cached pairs
    prefix = [(k[:, :4], v[:, :4]) for k, v in cache]
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[:, :4] = True
    mask[0, 4] = mask[1, 5] = mask[2, 5] = mask[2, 6] = True
    tree, _ = head(emb[[4, 4, 5]], feat[[4, 4, 5]], torch.tensor([4, 4, 5]), prefix, mask)
    torch.testing.assert_close(tree[1], whole[4], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tree[2], whole[5], atol=1e-5, rtol=1e-5)


def test_confidence_tree_keeps_the_best_scored_nodes():
    """The module docstring's example: top_k 2, nodes 3."""
    v = 8
    first = torch.full((v,), -float("inf"))
    first[1], first[2] = -0.1, -2.3  # a = 1, b = 2

    def expand(frontier, tokens, parents):
        out = torch.full((len(frontier), v), -float("inf"))
        for row, c in enumerate(frontier):
            if tokens[c] == 1:
                out[row, 3], out[row, 4] = -0.1, -2.9  # c, d
            else:
                out[row, 5], out[row, 6] = -0.2, -1.7  # e, f
        return out

    tree = confidence_tree(0, first, expand, top_k=2, depth=2, nodes=3)
    assert (tree.tokens, tree.parents) == ((1, 2, 3), (0, 0, 1))
    assert confidence_tree(0, first, expand, top_k=2, depth=1, nodes=8).tokens == (1, 2)  # -inf never drafted


@pytest.mark.parametrize("tree", [{"top_k": 1, "depth": 4, "nodes": 4}, {}], ids=["chain", "tree"])
def test_greedy_identical_to_the_target_alone(models, tree):
    target, head, refs = models
    for prompt, ref in zip(PROMPTS, refs, strict=True):
        (out,) = decoder(target, head, **tree).generate([prompt], GREEDY)
        assert out.output == ref
    outs = decoder(target, head, **tree).generate(PROMPTS, GREEDY)  # a mixed batch
    assert [o.output for o in outs] == refs
    assert sum(o.stats.accepted for o in outs) > 0  # the head's drafts are sometimes right


def test_chunked_prefill_and_joining_mid_stream_stay_exact(models):
    """The head's cache follows the target's through prefill chunks, joins and releases."""
    target, head, refs = models
    dec = decoder(target, head, chunk=3)
    assert joined_mid_stream(dec, PROMPTS, GREEDY) == refs
    assert not dec.target.drafted and not dec.target.heads.caches  # released with their sequences


def test_head_cache_follows_the_targets(models):
    target, head, _ = models
    dec = decoder(target, head, chunk=4)
    seq = dec.add(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8))
    for _ in range(5):  # three prefill chunks, then verifies
        dec.step()
        # pairs (x_{t+1}, f_t) for every position the target has kept
        assert dec.target.heads.caches[seq].length == dec.target.runner.lens[dec.target.runner.row(seq)]
    assert dec.target.runner.lens[dec.target.runner.row(seq)] == len(dec.active[seq].tokens) - 1


def test_seeded_sampling_gives_plain_sampling_output(models):
    """EAGLE trees are deterministic drafts: target-sample matching emits what plain sampling emits."""
    target, head, _ = models
    sampled = [SamplingParams(temperature=0.9, top_k=40, max_tokens=NEW, seed=s) for s in (1, 2, 3, 4)]
    plain = [o.output for o in decoder(target, None).generate(PROMPTS, sampled)]
    assert [o.output for o in decoder(target, head).generate(PROMPTS, sampled)] == plain
