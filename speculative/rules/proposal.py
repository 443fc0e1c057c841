"""What a drafter hands the acceptance rules: a draft tree and, for sampled drafts, its draft distributions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculative.rules.tree import TokenTree


@dataclass(frozen=True)
class Proposal:
    """A draft tree and, for sampled drafts, the exact draft distributions it was drawn from."""

    tree: TokenTree
    draft_probs: torch.Tensor | None = None  # [n+1, V]: row i = q the children of node i were sampled from
