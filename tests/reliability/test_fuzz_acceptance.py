"""Property-based tests (hypothesis) of the acceptance rules on random trees, logits and sampling settings.

For every rule: the accepted nodes form a path from the root, a step emits len(accepted) + 1
tokens (the accepted draft tokens, then one more), and the extra token does not continue the tree.
Greedy equals an independent argmax walk; target-sample matching equals plain keyed sampling;
rejection sampling with q == p accepts every first child. The probabilities fed to the rules are
well-formed for any temperature, top-k and top-p.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speculative.rules.acceptance import Verdict, accept_by_rejection, accept_by_target_sample, accept_greedy
from speculative.rules.rng import KeyedDraws, Stream, sample
from speculative.rules.sampling import SamplingParams, probs_from_logits
from speculative.rules.tree import TokenTree

V = 8  # a small vocabulary: drafted tokens often match the target's choice
SETTINGS = settings(max_examples=300, deadline=None)


@st.composite
def trees(draw: st.DrawFn, max_nodes: int = 10) -> TokenTree:
    """A random draft tree: each node under an earlier node, siblings with distinct tokens."""
    parents: list[int] = []
    tokens: list[int] = []
    for node in range(1, draw(st.integers(0, max_nodes)) + 1):
        parent = draw(st.integers(0, node - 1))
        taken = {tokens[i] for i, p in enumerate(parents) if p == parent}
        free = [t for t in range(V) if t not in taken]
        if free:
            parents.append(parent)
            tokens.append(draw(st.sampled_from(free)))
    return TokenTree(draw(st.integers(0, V - 1)), tuple(tokens), tuple(parents))


def logits_for(tree: TokenTree, seed: int, scale: float = 3.0) -> torch.Tensor:  # [n+1, V]
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tree.size + 1, V, generator=gen) * scale


def walk(tree: TokenTree, verdict: Verdict) -> list[int]:
    """Check the verdict's shape; the tree nodes at which each emitted token was chosen."""
    assert len(verdict.tokens) == len(verdict.accepted) + 1
    nodes = [0]
    for node in verdict.accepted:
        assert tree.parents[node - 1] == nodes[-1], "accepted nodes form a root path"
        nodes.append(node)
    assert list(verdict.tokens[:-1]) == [tree.token(n) for n in verdict.accepted]
    last_children = {tree.token(c) for c in tree.children[nodes[-1]]}
    assert verdict.tokens[-1] not in last_children, "the walk stops only where no child matches"
    return nodes


@SETTINGS
@given(trees(), st.integers(0, 2**31))
def test_greedy_is_the_argmax_walk(tree: TokenTree, seed: int) -> None:
    logits = logits_for(tree, seed)
    verdict = accept_greedy(tree, logits)
    for node, token in zip(walk(tree, verdict), verdict.tokens, strict=True):
        assert token == int(logits[node].argmax())


@SETTINGS
@given(trees(), st.integers(0, 2**31), st.integers(0, 2**62), st.integers(1, 500))
def test_target_sample_matching_equals_plain_keyed_sampling(tree: TokenTree, seed: int, key: int, base: int) -> None:
    probs = torch.softmax(logits_for(tree, seed), -1)  # [n+1, V]
    keyed = KeyedDraws(key, Stream.TARGET)
    verdict = accept_by_target_sample(tree, probs, lambda depth, index: keyed(base + depth, index))
    for k, (node, token) in enumerate(zip(walk(tree, verdict), verdict.tokens, strict=True)):
        assert tree.depths[node] == k
        assert token == sample(probs[node], keyed(base + k, 0)), "what plain sampling emits at this position"


@SETTINGS
@given(trees(), st.integers(0, 2**31), st.integers(0, 2**62), st.booleans())
def test_rejection_sampling_shape_and_q_equals_p(tree: TokenTree, seed: int, key: int, same: bool) -> None:
    target = torch.softmax(logits_for(tree, seed), -1)  # [n+1, V]
    draft = target if same else torch.softmax(logits_for(tree, seed + 1), -1)  # [n+1, V]
    keyed = KeyedDraws(key, Stream.TARGET)
    verdict = accept_by_rejection(tree, target, draft, lambda depth, index: keyed(depth, index))
    nodes = walk(tree, verdict)
    assert float(target[nodes[-1], verdict.tokens[-1]]) > 0, "the last token has target mass"
    if same:  # p(x)/q(x) = 1: the first child of every node on the path is accepted
        node, expected = 0, []
        while tree.children[node]:
            node = tree.children[node][0]
            expected.append(node)
        assert list(verdict.accepted) == expected


def test_rejection_refuses_a_draft_token_the_draft_could_not_have_sampled() -> None:
    tree = TokenTree.chain(0, [3])
    q = torch.full((2, V), 1.0 / (V - 1))
    q[0, 3] = 0.0
    with pytest.raises(ValueError, match="zero draft probability"):
        accept_by_rejection(tree, torch.full((2, V), 1.0 / V), q, lambda depth, index: 0.5)


@SETTINGS
@given(
    st.integers(0, 2**31),
    st.floats(0.0, 100.0, exclude_min=True),  # down to the least double: no overflow to NaN
    st.integers(0, 2 * V),
    st.floats(0.0, 1.0, exclude_min=True),
    st.floats(0.1, 50.0),
)
def test_probabilities_are_well_formed(seed: int, temperature: float, top_k: int, top_p: float, scale: float) -> None:
    logits = logits_for(TokenTree.chain(0, [1, 2, 3]), seed, scale)  # [4, V]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    probs = probs_from_logits(logits, params)  # [4, V]
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert torch.allclose(probs.sum(-1), torch.ones(4), atol=1e-5)
    assert (probs.gather(-1, logits.argmax(-1, keepdim=True)) > 0).all(), "the most likely token always survives"
    if 0 < top_k < V:  # ties at the k-th value are kept; random logits have none
        assert ((probs > 0).sum(-1) <= top_k).all()
