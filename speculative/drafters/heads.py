"""Drafts made beside the target by heads reading its hidden states (Medusa, EAGLE): the common part.

After each verify forward the target verifier hands a `TreeHeads` the last hidden states of every
position it kept (catch-up tokens and the accepted path), and the heads answer with the next round's
tree, rooted at the bonus token the verdict just committed. The tree rides back with the verdict
(`Verdict.drafted`), so the router (or the in-process decoder) drafts it with no draft model and no
extra hop: `TreeDrafter` keeps each sequence's latest tree and cuts it to the round's planned depth.

A tree is only a proposal: a stale one (the sequence moved on, a restart) is not used, and a sequence
without one drafts nothing that round. Neither can change the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from speculative.drafters.base import DraftRequest, Proposal, empty_proposal
from speculative.rules.tree import TokenTree


@dataclass(frozen=True)
class HeadInput:
    """What one verify forward gives the heads of one sequence."""

    seq_id: str
    tokens: Sequence[int]  # the sequence's committed tokens after this verify (the bonus last)
    start: int  # position of the first of `features`
    features: torch.Tensor  # [n, H] the target's last hidden states at positions start..start+n-1
    draft: bool  # the verify committed tokens (False: a prefill chunk, nothing to draft yet)

    @property
    def reaches_bonus(self) -> bool:
        """The features run up to the state the bonus token came from: a tree can be drafted after it."""
        return self.draft and self.start + len(self.features) == len(self.tokens) - 1


class TreeHeads(Protocol):
    """Heads that read the target's hidden states and draft the next round's tree."""

    def advance(self, rows: list[HeadInput]) -> list[TokenTree | None]:
        """Take one forward's features, all its sequences at once; per row the next round's tree (None:
        none this time)."""
        ...

    def release(self, seq_ids: list[str]) -> None: ...


def read_state(root: Path, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The state dict in the first of `names` found in `root` (safetensors or a torch pickle of tensors);
    FileNotFoundError naming them all if none is there."""
    weights = next((root / w for w in names if (root / w).exists()), None)
    if weights is None:
        raise FileNotFoundError(f"{root}: no {' or '.join(names)}")
    if weights.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(weights))
    return torch.load(weights, map_location="cpu", weights_only=True)


@dataclass(frozen=True)
class NextTree:
    """The tree the heads drafted after a sequence's last verify, for the sequence at `length` tokens."""

    length: int  # committed tokens the tree follows (its root the last of them)
    tree: TokenTree


def cut(tree: TokenTree, depth: int, nodes: int | None = None) -> TokenTree:
    """`tree` without its nodes deeper than `depth`, and past the first `nodes` of those (node order keeps
    parents before children, so what is left is a tree)."""
    keep = [i for i in range(1, tree.size + 1) if tree.depths[i] <= depth][: nodes if nodes is not None else None]
    index = {0: 0, **{node: k + 1 for k, node in enumerate(keep)}}
    return TokenTree(
        tree.root, tuple(tree.tokens[i - 1] for i in keep), tuple(index[tree.parents[i - 1]] for i in keep)
    )


class TreeDrafter:
    """Proposals from the trees the heads drafted (`trees`, by sequence id, shared with whoever stores
    them: the verifier in-process, the router's lane when they come back with the verdicts), cut to each
    request's budget. No forward here; a sequence with no tree for its current length drafts nothing."""

    def __init__(self, trees: dict[str, NextTree]) -> None:
        self.trees = trees

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        out = []
        for r in requests:
            found = self.trees.get(r.seq_id)
            if found is None or found.length != len(r.tokens) or r.budget <= 0 or r.spine:
                out.append(empty_proposal(r))
                continue
            out.append(Proposal(cut(found.tree, r.budget)))
        return out

    def release(self, seq_ids: list[str]) -> None:
        for s in seq_ids:
            self.trees.pop(s, None)

    def cached_sequences(self) -> int:
        return len(self.trees)
