"""An oracle drafter of set acceptance rate: speculation measured without a trained draft model.

Given the target's own greedy sequences (computed first by the target alone), it proposes chains
where each token is the target's next token with probability `acceptance`, else a wrong one, and
after a miss only wrong tokens (a real draft that left the target's path stays off it). Whether a
position is right is keyed by (seed, reference, position), so it is decided once per position:
the same whatever the batch, the chain length or the step that drafts it, and the target sees
independent Bernoulli(acceptance) tokens, as the performance model of docs/design.md assumes. Drafting
costs no model forward, so D = 0 and the measured speedup isolates the system's own overhead.
"""

from __future__ import annotations

from dataclasses import dataclass

from speculative.drafters.base import DraftRequest, Proposal, empty_proposal
from speculative.rules.rng import Stream, uniform
from speculative.rules.tree import TokenTree


@dataclass
class OracleStats:
    right: int = 0  # drafted tokens equal to the target's next tokens before the first miss
    misses: int = 0  # chains with a wrong token within their budget
    off_reference: int = 0  # requests whose tokens left every reference (the target diverged)

    @property
    def acceptance(self) -> float:
        """Per-token acceptance the target saw: right / (right + misses)."""
        tested = self.right + self.misses
        return self.right / tested if tested else 0.0


class OracleDrafter:
    """Chains from known greedy continuations, each token right with probability `acceptance`."""

    def __init__(self, references: list[list[int]], acceptance: float, vocab_size: int, seed: int = 0) -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance: expected 0..1, got {acceptance}")
        if vocab_size < 2:
            raise ValueError(f"vocab_size: expected >= 2, got {vocab_size}")
        self.references = [list(r) for r in references]  # prompt + the target's greedy continuation
        self.acceptance, self.vocab_size, self.seed = acceptance, vocab_size, seed
        self.stats = OracleStats()
        self._assigned: dict[str, int] = {}  # seq_id -> reference index

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        return [self._propose_one(req) for req in requests]

    def release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self._assigned.pop(seq_id, None)

    def cached_sequences(self) -> int:
        return len(self._assigned)

    def _propose_one(self, req: DraftRequest) -> Proposal:
        index = self._reference(req)
        if req.budget <= 0 or index is None:
            return empty_proposal(req)
        reference, start = self.references[index], len(req.tokens)
        truth = reference[start : start + req.budget]  # the target's next tokens
        key = self.seed * 1_000_003 + index
        draft: list[int] = []
        on_path = True
        for depth, token in enumerate(truth):
            position = start + depth
            right = on_path and uniform(key, position, Stream.DRAFT, 0) < self.acceptance
            if right:
                draft.append(token)
                self.stats.right += 1
                continue
            if on_path:  # the chain's first miss: the target rejects here
                self.stats.misses += 1
                on_path = False
            shift = 1 + int(uniform(key, position, Stream.DRAFT, 1) * (self.vocab_size - 1))
            draft.append((token + shift) % self.vocab_size)  # never the target's token
        return Proposal(TokenTree.chain(req.tokens[-1], draft))

    def _reference(self, req: DraftRequest) -> int | None:
        """The reference this sequence follows, or None once its tokens left it."""
        tokens = list(req.tokens)
        index = self._assigned.get(req.seq_id)
        candidates = [index] if index is not None else range(len(self.references))
        for i in candidates:
            if self.references[i][: len(tokens)] == tokens:
                self._assigned[req.seq_id] = i
                return i
        self.stats.off_reference += 1
        return None
