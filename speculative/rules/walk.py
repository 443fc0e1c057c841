"""The acceptance rules of `acceptance.py` for every row at once, as tensor operations on the logits'
device: nothing is read back until the walk is done, and then one [R, D + 2] tensor of ids is.

On a GPU each `.item()` or `.tolist()` waits for the device to finish; `acceptance.py` walks one tree
on the host, reading a token per node. Here the rows' trees are tensors (`Trees`), the walk takes one
step per depth for all rows together, and each row follows its own rule:

- GREEDY: descend into the child equal to the node's argmax; emit the argmax where it stops;
- SAMPLE (deterministic drafts): x = inverse-CDF sample of p at the node with the node's keyed
  uniform; descend into the child equal to x, else emit x;
- REJECT (drafts sampled from q): recursive rejection over the node's children in draft order,
  p <- norm(max(p - q, 0)) and q without the rejected token after each rejection; on rejecting
  all, a sample of the residual p.

The arithmetic is `acceptance.py`'s (float64 where it computes in float64, the same uniforms from
`rng`), so a row's verdict is the host walk's. Example: greedy, a chain root -> a -> b with the
argmax a at the root, c at a: path [1, -1, ...], last c (node 1 accepted, c emitted).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from speculative.rules.tree import TokenTree


class Rule(enum.IntEnum):
    GREEDY = 0
    SAMPLE = 1
    REJECT = 2


@dataclass(frozen=True)
class Trees:
    """R rows' trees as tensors; N = the largest tree's nodes (root included), K = most children of a node."""

    tokens: torch.Tensor  # [R, N] int64: each node's token, pads -1
    children: torch.Tensor  # [R, N, K] int64: each node's children in draft order, pads -1
    depth: int  # the deepest node of any row

    @staticmethod
    def of(trees: list[TokenTree], device: torch.device) -> Trees:
        """Built on the host from the trees' lists, one copy to `device` each."""
        nodes = max(t.size + 1 for t in trees)
        fan = max(1, max(len(c) for t in trees for c in t.children))
        tokens = [[*t.all_tokens, *[-1] * (nodes - t.size - 1)] for t in trees]
        children = [
            [[*t.children[n], *[-1] * (fan - len(t.children[n]))] if n <= t.size else [-1] * fan for n in range(nodes)]
            for t in trees
        ]
        depth = max(max(t.depths) for t in trees)
        return Trees(
            torch.tensor(tokens, dtype=torch.long, device=device),
            torch.tensor(children, dtype=torch.long, device=device),
            depth,
        )


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:  # [R, V] float64, [R] -> [R] int64
    """`rng.sample` per row: the token where u * total falls in the CDF; a tie onto a boundary past the
    last token with mass takes that token."""
    cdf = probs.cumsum(-1)  # [R, V]
    at = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]  # [R]
    vocab = probs.shape[-1]
    mass = probs > 0.0  # [R, V]
    last = (mass * torch.arange(vocab, device=probs.device)).amax(-1)  # [R] the last token with mass
    off = (at >= vocab) | ~mass.gather(1, at.clamp(max=vocab - 1)[:, None])[:, 0]
    return torch.where(off, last, at)


def walk(
    trees: Trees,
    rules: torch.Tensor,  # [R] int64 `Rule`
    best: torch.Tensor,  # [R, N] int64: each node's argmax (GREEDY rows)
    probs: torch.Tensor | None,  # [R, N, V] the target's p at each node (SAMPLE, REJECT rows)
    draft: torch.Tensor | None,  # [R, N, V] the q each node's children were sampled from (REJECT rows)
    uniforms: torch.Tensor,  # [R, depth + 1, K + 1] float64: the keyed uniform of (node depth, index)
) -> torch.Tensor:  # [R, depth + 2] int64: accepted nodes root excluded (pads -1), then the emitted token
    rows_n = trees.tokens.shape[0]
    rows = torch.arange(rows_n, device=best.device)
    node = torch.zeros(rows_n, dtype=torch.long, device=best.device)  # [R] where each row's walk is
    done = torch.zeros(rows_n, dtype=torch.bool, device=best.device)
    path = torch.full((rows_n, trees.depth + 1), -1, dtype=torch.long, device=best.device)
    last = torch.zeros(rows_n, dtype=torch.long, device=best.device)
    for d in range(trees.depth + 1):
        kids = trees.children[rows, node]  # [R, K]
        kid_tokens = torch.where(kids >= 0, trees.tokens.gather(1, kids.clamp_min(0)), -1)  # [R, K]
        x = best[rows, node]  # [R] the target's token here (GREEDY; SAMPLE below)
        p = None if probs is None else probs[rows, node].double()  # [R, V]
        if p is not None:
            x = torch.where(rules == Rule.SAMPLE, inverse_cdf(p, uniforms[:, d, 0]), x)
        match = (kid_tokens == x[:, None]) & (kids >= 0)  # [R, K] (children's tokens differ: one at most)
        step = kids.gather(1, match.long().argmax(1, keepdim=True))[:, 0]  # [R]
        stop = ~match.any(1)
        if p is not None and draft is not None:
            chosen, residual = _reject(p, draft[rows, node].double(), kids, kid_tokens, uniforms[:, d])
            rejecting = rules == Rule.REJECT
            step = torch.where(rejecting, chosen, step)
            stop = torch.where(rejecting, chosen < 0, stop)
            x = torch.where(rejecting, residual, x)
        last = torch.where(stop & ~done, x, last)
        going = ~stop & ~done
        path[:, d] = torch.where(going, step, -1)
        node = torch.where(going, step, node)
        done = done | stop
    return torch.cat([path, last[:, None]], dim=1)


def _reject(
    p: torch.Tensor,  # [R, V] float64
    q: torch.Tensor,  # [R, V] float64
    kids: torch.Tensor,  # [R, K] children in draft order, pads -1
    kid_tokens: torch.Tensor,  # [R, K]
    u: torch.Tensor,  # [R, K + 1]: child j's uniform at j, the residual sample's at the number of children
) -> tuple[torch.Tensor, torch.Tensor]:  # [R] the accepted child (-1: none), [R] the residual's sample
    """`acceptance.accept_by_rejection` at one node of every row."""
    chosen = torch.full_like(kids[:, 0], -1)
    searching = torch.ones_like(kids[:, 0], dtype=torch.bool)
    for j in range(kids.shape[1]):
        trying = (kids[:, j] >= 0) & searching
        x = kid_tokens[:, j].clamp_min(0)[:, None]  # [R, 1]
        accept = trying & (u[:, j] * q.gather(1, x)[:, 0] < p.gather(1, x)[:, 0])  # u < p(x)/q(x)
        chosen = torch.where(accept, kids[:, j], chosen)
        reject = (trying & ~accept)[:, None]  # [R, 1]
        residual = (p - q).clamp_min(0.0)
        mass = residual.sum(-1, keepdim=True)
        p = torch.where(reject & (mass > 0.0), residual / mass, p)  # no residual: rejection had probability 0
        dropped = q.scatter(1, x, 0.0)
        left = dropped.sum(-1, keepdim=True)
        q = torch.where(reject, torch.where(left > 0.0, dropped / left, dropped), q)
        searching = searching & ~accept
    tried = (kids >= 0).sum(1, keepdim=True)  # [R, 1]
    return chosen, inverse_cdf(p, u.gather(1, tried)[:, 0])
