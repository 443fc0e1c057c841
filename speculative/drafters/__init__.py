"""Drafters: whatever proposes token trees for the target to verify."""

from speculative.drafters.base import Drafter, DraftRequest, Proposal

__all__ = ["DraftRequest", "Drafter", "Proposal"]
