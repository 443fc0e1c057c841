"""The drafter interface: propose a tree per sequence; forget sequences when told.

A drafter holds only soft state (caches). Each request carries the sequence's committed tokens,
so a drafter that restarted, or never saw the sequence, rebuilds what it needs from them: a miss
costs time, never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from speculative.sampling import SamplingParams
from speculative.tree import TokenTree


@dataclass(frozen=True)
class DraftRequest:
    """Draft for one sequence."""

    seq_id: str
    tokens: tuple[int, ...]  # committed tokens, prompt included; the last one is the tree's root
    budget: int  # most draft tokens along any path (speculation length); 0 = propose nothing
    params: SamplingParams
    prompt_len: int = 0  # how many of `tokens` are the prompt (output penalties, min_tokens)


@dataclass(frozen=True)
class Proposal:
    """A draft tree and, for sampled drafts, the exact draft distributions it was drawn from."""

    tree: TokenTree
    draft_probs: torch.Tensor | None = None  # [n+1, V]: row i = q the children of node i were sampled from


class Drafter(Protocol):
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        """One proposal per request, in order."""
        ...

    def release(self, seq_ids: list[str]) -> None:
        """Free everything held for these sequences (unknown ids are ignored)."""
        ...

    def cached_sequences(self) -> int:
        """How many sequences this drafter holds state for (what `release` frees)."""
        ...


def empty_proposal(request: DraftRequest) -> Proposal:
    return Proposal(TokenTree.chain(request.tokens[-1], []))
