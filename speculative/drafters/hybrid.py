"""Prompt lookup first, the draft model where lookup finds nothing.

Lookup drafts cost nothing; where the output quotes the context (code edits, extraction,
repetition) they are long and right. Elsewhere the draft model proposes as usual. Lookup chains
are deterministic and model drafts may be sampled: each proposal carries what its own acceptance
rule needs, so mixing them per sequence and per step stays exact.
"""

from __future__ import annotations

from speculative.drafters.base import Drafter, DraftRequest, Proposal
from speculative.drafters.lookup import PromptLookupDrafter


class HybridDrafter:
    def __init__(self, lookup: PromptLookupDrafter, model: Drafter, min_lookup: int = 2) -> None:
        self.lookup = lookup
        self.model = model
        self.min_lookup = min_lookup  # shorter lookup drafts go to the model instead

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        found = self.lookup.propose(requests)
        drafted = [p.tree.size - r.spine for p, r in zip(found, requests, strict=True)]  # a pre-draft's spine aside
        use_lookup = [n >= min(self.min_lookup, r.budget) and n > 0 for n, r in zip(drafted, requests, strict=True)]
        rest = [r for r, hit in zip(requests, use_lookup, strict=True) if not hit]
        modelled = iter(self.model.propose(rest) if rest else [])
        return [p if hit else next(modelled) for p, hit in zip(found, use_lookup, strict=True)]

    def release(self, seq_ids: list[str]) -> None:
        self.lookup.release(seq_ids)
        self.model.release(seq_ids)

    def cached_sequences(self) -> int:
        return self.lookup.cached_sequences() + self.model.cached_sequences()
