"""The drafter interface: propose a tree per sequence; forget sequences when told.

A drafter holds only soft state (caches). Each request carries the sequence's committed tokens,
so a drafter that restarted, or never saw the sequence, rebuilds what it needs from them: a miss
costs time, never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from speculative.rules.proposal import Proposal
from speculative.rules.sampling import SamplingParams
from speculative.rules.tree import TokenTree


@dataclass(frozen=True)
class DraftRequest:
    """Draft for one sequence."""

    seq_id: str
    tokens: tuple[int, ...]  # committed tokens, prompt included; the last one is the tree's root
    budget: int  # most draft tokens along any path (speculation length); 0 = propose nothing
    params: SamplingParams
    prompt_len: int = 0  # how many of `tokens` are the prompt (output penalties, min_tokens)
    # A pre-draft (speculative/planning/ahead.py): the last `spine` of `tokens` are drafts assumed accepted, not
    # committed. The tree is then rooted at the last committed token, holds the spine as its first path,
    # drafts the guess of the bonus and `budget - 1` under it at the spine's end, and `alternatives`
    # more branches where the spine is likeliest cut (the draft's best other token there, `budget - 1`
    # under it), so a verdict that cuts the spine can still find its next round drafted.
    spine: int = 0
    alternatives: int = 0
    # A pre-draft hides behind a verify: it stops growing before a forward that would end more than
    # `deadline_s` seconds after it began (the verify's predicted seconds), so the round that takes it
    # does not wait for it. None: the whole budget.
    deadline_s: float | None = None

    @property
    def pre_draft(self) -> bool:
        """Made beside a verify for the round after it (a spine, alternatives or a deadline); one beside a
        verify of no draft has no spine, and its guesses are of that verify's token."""
        return self.spine > 0 or self.alternatives > 0 or self.deadline_s is not None

    @property
    def committed(self) -> tuple[int, ...]:
        """The tokens the target has committed: `tokens` without the spine."""
        return self.tokens[: len(self.tokens) - self.spine]


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
    return Proposal(TokenTree.chain(request.committed[-1], []))


def behind_spine(request: DraftRequest, proposal: Proposal) -> Proposal:
    """A proposal drafted from all of a pre-draft's tokens (rooted at the spine's end), re-rooted at the last
    committed token with the spine as its first path (no alternatives); unchanged without a spine.

    tokens [.., 7, 3, 9] with spine 2 and the chain 9 -> [5, 2] give 7 -> [3, 9, 5, 2].
    """
    s = request.spine
    if not s:
        return proposal
    if proposal.draft_probs is not None:
        raise ValueError("a pre-draft's spine is for deterministic drafts; this one was sampled")
    tree = proposal.tree
    tokens = (*request.tokens[-s:], *tree.tokens)
    parents = (*range(s), *(p + s for p in tree.parents))
    return Proposal(TokenTree(request.committed[-1], tokens, parents))
