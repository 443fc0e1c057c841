"""Prompt lookup: copy what followed the latest earlier occurrence of the last n-gram. No model."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from speculative.drafters.base import DraftRequest, Proposal, empty_proposal
from speculative.tree import TokenTree


def lookup_match(
    tokens: torch.Tensor,  # [L] int64, the sequence so far
    max_ngram: int,
    min_ngram: int,
    length: int,
) -> tuple[int, list[int]]:
    """(n, the tokens that followed the most recent earlier match of the longest matching suffix n-gram);
    (0, []) without a match. n says how much to trust them: a 3-gram match is mostly text being quoted,
    a 1-gram one mostly chance."""
    total = tokens.numel()
    for n in range(min(max_ngram, total - 1), min_ngram - 1, -1):
        windows = tokens[: total - 1].unfold(0, n, 1)  # [L-n, n], each window ends before the last token
        hits = torch.nonzero((windows == tokens[total - n :]).all(dim=1)).flatten()
        if hits.numel():
            start = int(hits[-1]) + n
            return n, tokens[start : start + length].tolist()
    return 0, []


def lookup_continuation(tokens: torch.Tensor, max_ngram: int, min_ngram: int, length: int) -> list[int]:
    """Tokens that followed the most recent earlier match of the longest matching suffix n-gram."""
    return lookup_match(tokens, max_ngram, min_ngram, length)[1]


class PromptLookupDrafter:
    """Deterministic chain drafts from n-gram matches in the prompt and output (Saxena 2023)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        out = []
        for req in requests:
            if req.budget <= 0:
                out.append(empty_proposal(req))
                continue
            seq = torch.tensor(req.tokens, dtype=torch.long)
            draft = lookup_continuation(seq, self.max_ngram, self.min_ngram, req.budget)
            out.append(Proposal(TokenTree.chain(req.tokens[-1], draft)))
        return out

    def match(self, tokens: Sequence[int], length: int) -> tuple[int, int]:
        """(matched n-gram length, tokens a proposal of at most `length` would draft); (0, 0): no match."""
        n, found = lookup_match(torch.tensor(tokens, dtype=torch.long), self.max_ngram, self.min_ngram, length)
        return n, len(found)

    def release(self, seq_ids: list[str]) -> None:
        return None

    def cached_sequences(self) -> int:
        return 0  # stateless: every proposal reads the request's tokens
