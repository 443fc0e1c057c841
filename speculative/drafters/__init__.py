"""Drafters: whatever proposes token trees for the target to verify (a draft model, prompt lookup, the two
as a hybrid, Medusa heads, an EAGLE head), their interface, and one config type per kind
(`drafters.config`), each building its drafter and saying where it runs.

May import: `speculative.rules`, `speculative.engine`.
"""

from speculative.drafters.base import Drafter, DraftRequest, Proposal

__all__ = ["DraftRequest", "Drafter", "Proposal"]
