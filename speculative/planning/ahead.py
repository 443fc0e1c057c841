"""Round-ahead drafting: the draft of round N+1 made while the target verifies round N.

Glossary:
- assumed path (the spine): the draft tokens of round N that the pre-draft takes as accepted, the tree's
  first child at every depth (for top-k and chain drafts, the draft's most likely continuation);
- guess: a child of the spine's end, the draft's guess of round N's bonus token;
- alternative: a child of a spine node other than the spine's own, the draft's guess of the target's
  token where the verdict cuts the spine (`DraftRequest.alternatives`, placed where the draft is least
  sure of the spine);
- hit: the verdict's tokens (accepted drafts, then the bonus) are a path of the pre-draft from its root;
  the subtree under that path's end is then round N+1's proposal, ready when the verdict arrives.

Worked example (a chain of 2, then a pre-draft of depth 2 with one alternative):

    committed  [.., 7]         round N drafts 7 -> [3, 9]
    pre-draft  tokens [.., 7, 3, 9], spine 2, budget 3  ->  7 -> 3 -> 9 -> [5, 2, 8]   (5: the guess)
                                                            7 -> 3 -> [4, 6, 1]      (4: an alternative)
    verdict    tokens (3, 9, 5): a path to 5       ->  hit: round N+1 drafts 5 -> [2, 8]
    verdict    tokens (3, 4):    cut at 9, a path  ->  hit: round N+1 drafts 4 -> [6, 1]
    verdict    tokens (8,):      cut at 3          ->  miss: redraft from [.., 7, 8]

A pre-draft is only a proposal: whatever it holds, the target's verdict decides every token, so it
cannot change output under greedy decoding or deterministic drafts (the keyed target sample decides
each token). Sampled drafts are not pre-drafted: their committed tokens depend on the draft drawn.
"""

from __future__ import annotations

from dataclasses import replace

from speculative.drafters.base import DraftRequest, Proposal
from speculative.rules.tree import TokenTree


def assumed_path(tree: TokenTree) -> list[int]:
    """The first child's token at every depth, from the root down: the continuation a pre-draft assumes.

    chain 7 -> [3, 9] gives [3, 9]; a tree whose root has children 3 (first) and 4 gives 3, then 3's
    first child, and so on; an empty tree gives [].
    """
    out, node = [], 0
    while tree.children[node]:
        node = tree.children[node][0]
        out.append(tree.tokens[node - 1])
    return out


def ahead_request(
    base: DraftRequest, tree: TokenTree, alternatives: int = 0, deadline_s: float | None = None
) -> DraftRequest:
    """The pre-draft for round N+1 from `base`, the request round N+1 would make of round N's committed
    tokens (`base.budget`: its depth): the assumed path of `tree` (round N's draft) as its spine, drafting
    the guess and `base.budget` levels under it, and under each of `alternatives` branches where the spine
    may be cut; no level started that would end past `deadline_s` (`DraftRequest.deadline_s`)."""
    path = assumed_path(tree)
    tokens, budget, spine = (*base.tokens, *path), base.budget + 1, len(path)
    return replace(base, tokens=tokens, budget=budget, spine=spine, alternatives=alternatives, deadline_s=deadline_s)


def take_ahead(pre: Proposal, committed: tuple[int, ...]) -> Proposal | None:
    """Round N+1's proposal from a pre-draft (rooted at round N's root), if it was a hit; `committed`: round
    N's verdict tokens (accepted draft tokens, then the bonus). None on a miss, when the subtree under the
    verdict holds no draft, or when the pre-draft was sampled."""
    if pre.draft_probs is not None or not committed:
        return None
    tree, node = pre.tree, 0
    for token in committed:
        child = next((c for c in tree.children[node] if tree.tokens[c - 1] == token), None)
        if child is None:
            return None
        node = child
    taken = subtree(tree, node)
    return Proposal(taken) if taken.size else None


def subtree(tree: TokenTree, node: int) -> TokenTree:
    """The tree below `node`, re-rooted there (node order kept: parents still precede children).

    chain 7 -> [5, 2, 8] at node 1 (token 5) gives 5 -> [2, 8].
    """
    keep, index = [node], {node: 0}
    for child in range(node + 1, tree.size + 1):
        if tree.parents[child - 1] in index:
            index[child] = len(keep)
            keep.append(child)
    tokens = tuple(tree.tokens[c - 1] for c in keep[1:])
    parents = tuple(index[tree.parents[c - 1]] for c in keep[1:])
    return TokenTree(tree.token(node), tokens, parents)
