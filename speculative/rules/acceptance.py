"""Acceptance rules: which draft tokens the target keeps, and the token it adds.

Glossary (after vLLM's rejection sampler):
- accepted: draft nodes the rule keeps, a path from the root of the tree;
- recovered: the token the target emits at the first node where no child is accepted (sampled
  from the residual distribution under rejection sampling);
- bonus: the token emitted after a fully accepted path (from the target's p at the leaf).
Every step emits len(accepted) + 1 tokens: the accepted draft tokens, then one recovered or bonus
token, so plain decoding is the case of an empty tree.

All rules are exact: greedy output equals the target's argmax decoding; sampled output is
distributed as the target's own sampling. Each is proven by a statistical test in
tests/unit/test_acceptance_distribution.py.

`draw(depth, index)` supplies uniforms for the decision at a node of `depth` (root = 0), keyed by
position so that results do not depend on batching or speculation length (see rng.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from speculative.rules.logprobs import TokenLogprob
from speculative.rules.rng import sample
from speculative.rules.tree import TokenTree

Draw = Callable[[int, int], float]


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one tree."""

    accepted: tuple[int, ...]  # accepted node indices, root excluded, root-to-leaf order
    tokens: tuple[int, ...]  # emitted tokens: accepted draft tokens then the recovered/bonus token
    logprobs: tuple[TokenLogprob, ...] | None = None  # per token, when the request asks (logprobs.py)
    # the next round's tree, rooted at the bonus, drafted by heads beside the target (drafters/heads.py;
    # None: no heads), riding back with the verdict
    drafted: TokenTree | None = None
    # why this sequence alone failed at the target (its grammar, its parameters); it ends with this error,
    # and the other sequences of its forward go on. None: a verdict
    error: str | None = None

    @property
    def path(self) -> tuple[int, ...]:
        """Tree nodes whose KV the target keeps: the root and the accepted nodes."""
        return (0, *self.accepted)


def _verdict(tree: TokenTree, accepted: list[int], last: int) -> Verdict:
    return Verdict(tuple(accepted), (*[tree.token(n) for n in accepted], last))


def _child_with_token(tree: TokenTree, node: int, token: int) -> int | None:
    for child in tree.children[node]:
        if tree.token(child) == token:
            return child
    return None


def accept_greedy(
    tree: TokenTree,
    target_scores: torch.Tensor,  # [n+1, V] logits after penalty, row i = next-token scores at node i
) -> Verdict:
    """Descend into the child equal to argmax p; the last token is argmax p where the walk stops."""
    return follow_choices(tree, target_scores.argmax(-1).tolist())


def follow_choices(tree: TokenTree, best: list[int]) -> Verdict:
    """`accept_greedy` from the target's choice at each node (`best[i]`: argmax at node i, [n+1])."""
    node, accepted = 0, list[int]()
    while (child := _child_with_token(tree, node, best[node])) is not None:
        accepted.append(child)
        node = child
    return _verdict(tree, accepted, best[node])


def accept_by_target_sample(
    tree: TokenTree,
    target_probs: torch.Tensor,  # [n+1, V]
    draw: Draw,
) -> Verdict:
    """For deterministic drafts: sample x ~ p at the node; descend if x was drafted, else emit x.

    The emitted tokens are exactly what plain sampling with the same keyed uniforms gives.
    """
    node, accepted = 0, list[int]()
    while True:
        x = sample(target_probs[node], draw(tree.depths[node], 0))
        child = _child_with_token(tree, node, x)
        if child is None:
            return _verdict(tree, accepted, x)
        accepted.append(child)
        node = child


def accept_by_rejection(
    tree: TokenTree,
    target_probs: torch.Tensor,  # [n+1, V]
    draft_probs: torch.Tensor,  # [n+1, V]; row i = q the children of node i were sampled from
    draw: Draw,
) -> Verdict:
    """Recursive rejection sampling (SpecInfer / RSD); with one child per node, Leviathan's rule.

    Children of a node must have been sampled from q without replacement, in the order drafted.
    Try them in order: accept x with probability min(1, p(x)/q(x)); on rejection set
    p <- norm(max(p - q, 0)) and drop x from q (renormalised). If all are rejected, sample from
    the residual p.
    """
    node, accepted = 0, list[int]()
    while True:
        depth = tree.depths[node]
        p = target_probs[node].double()
        q = draft_probs[node].double()
        next_node = None
        for j, child in enumerate(tree.children[node]):
            x = tree.token(child)
            qx = float(q[x])
            if qx <= 0.0:
                raise ValueError(f"draft token {x} at node {child} has zero draft probability")
            if draw(depth, j) * qx < float(p[x]):  # u < p(x)/q(x), without dividing
                next_node = child
                break
            residual = (p - q).clamp_min(0.0)
            # p == q leaves no residual, but then rejection had probability 0: keep p.
            p = residual / residual.sum() if float(residual.sum()) > 0.0 else p
            q = q.clone()
            q[x] = 0.0
            q = q / q.sum() if float(q.sum()) > 0.0 else q
        if next_node is None:
            n_tried = len(tree.children[node])
            return _verdict(tree, accepted, sample(p, draw(depth, n_tried)))
        accepted.append(next_node)
        node = next_node
