"""Round-ahead drafting: the draft of round N+1 made while the target verifies round N.

Glossary:
- assumed path: the draft tokens of round N that the pre-draft takes as accepted, the tree's first
  child at every depth (for top-k and chain drafts, the draft's most likely continuation);
- guess: a child of the pre-draft's root, the draft's guess of round N's bonus token;
- hit: the verdict accepted the whole assumed path and its bonus is one of the guesses; the subtree
  under that guess is then round N+1's proposal, ready when the verdict arrives.

Worked example (a chain of 2, then a pre-draft of depth 2 under one guess):

    committed  [.., 7]         round N drafts 7 -> [3, 9]
    pre-draft  tokens [.., 7, 3, 9], budget 3  ->  chain [5, 2, 8]   (5 is the guess)
    verdict    tokens (3, 9, 5): path accepted, bonus 5 == guess  ->  hit: round N+1 drafts 5 -> [2, 8]
    verdict    tokens (3, 4):    path cut at 9                     ->  miss: redraft from [.., 7, 3, 4]

A pre-draft is only a proposal: whatever it holds, the target's verdict decides every token, so it
cannot change output under greedy decoding or deterministic drafts (the keyed target sample decides
each token). Sampled drafts are not pre-drafted: their committed tokens depend on the draft drawn.
"""

from __future__ import annotations

from speculative.drafters.base import DraftRequest, Proposal
from speculative.sampling import SamplingParams
from speculative.tree import TokenTree


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
    seq_id: str, tokens: tuple[int, ...], tree: TokenTree, depth: int, params: SamplingParams, prompt_len: int = 0
) -> DraftRequest:
    """The pre-draft for round N+1: `tokens` (committed) plus the assumed path as context, drafting the
    guess and `depth` levels under it."""
    return DraftRequest(seq_id, (*tokens, *assumed_path(tree)), depth + 1, params, prompt_len)


def take_ahead(pre: Proposal, path: list[int], committed: tuple[int, ...]) -> Proposal | None:
    """Round N+1's proposal from a pre-draft, if it was a hit; `committed`: round N's verdict tokens
    (accepted draft tokens, then the bonus). None on a miss, or when the pre-draft was sampled."""
    if pre.draft_probs is not None or list(committed[:-1]) != path:
        return None
    tree, bonus = pre.tree, committed[-1]
    guess = next((c for c in tree.children[0] if tree.tokens[c - 1] == bonus), None)
    return None if guess is None else Proposal(subtree(tree, guess))


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
