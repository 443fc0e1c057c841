"""Prompt lookup: copy what followed the latest earlier occurrence of the last n-gram. No model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from speculative.drafters.base import DraftRequest, Proposal, behind_spine, empty_proposal
from speculative.rules.tree import TokenTree

MATCH_REACH = 16  # how far back before a match its context is compared (the most a run counts)
APART = -1  # between a request's prediction and its sequence in what lookup searches: no token, so nothing matches
# across it, and a continuation stops at it


def lookup_match(
    tokens: torch.Tensor,  # [L] int64, the sequence so far
    max_ngram: int,
    min_ngram: int,
    length: int,
) -> tuple[int, list[int]]:
    """(run, the tokens that followed the earlier occurrence of the longest matching suffix n-gram);
    (0, []) without a match. Of several occurrences, the one whose context agrees longest with the
    sequence's end (then the most recent); `run` is how far they agree: the n-gram and the tokens before
    it, at most MATCH_REACH. It says how much to trust the draft: text being quoted agrees for many
    tokens, a chance match for the n-gram alone, and drafts from long runs land far more often."""
    total = tokens.numel()
    for n in range(min(max_ngram, total - 1), min_ngram - 1, -1):
        windows = tokens[: total - 1].unfold(0, n, 1)  # [L-n, n], each window ends before the last token
        hits = torch.nonzero((windows == tokens[total - n :]).all(dim=1)).flatten()  # [h] window starts
        if hits.numel():
            back = torch.arange(1, MATCH_REACH - n + 1)  # [r] how far before the n-gram
            earlier, later = hits[:, None] - back, total - n - back  # [h, r], [r] positions compared
            same = (earlier >= 0) & (tokens[earlier.clamp_min(0)] == tokens[later.clamp_min(0)])  # [h, r]
            runs = n + same.cumprod(dim=1).sum(dim=1)  # [h] tokens agreeing, the n-gram's included
            best = int(torch.argmax(runs * total + hits))  # the longest run, then the most recent
            start = int(hits[best]) + n
            found = tokens[start : start + length].tolist()
            return int(runs[best]), found[: found.index(APART)] if APART in found else found
    return 0, []


def run_class(run: int) -> int:
    """The classes a lookup draft's acceptance is pooled by: runs of 1, 2-3, 4-7, 8-15, 16 (and 0)."""
    return 1 << (run.bit_length() - 1) if run > 0 else 0


def run_prior(run: int) -> float:
    """The chance that the token after a run of `run` agreeing tokens agrees too, before any evidence:
    Laplace's rule of succession, (run + 1) / (run + 2) (2/3 for a 1-token run, 17/18 for 16)."""
    return (run + 1) / (run + 2)


def lookup_continuation(tokens: torch.Tensor, max_ngram: int, min_ngram: int, length: int) -> list[int]:
    """Tokens that followed the earlier match of the longest matching suffix n-gram (`lookup_match`)."""
    return lookup_match(tokens, max_ngram, min_ngram, length)[1]


def split_lookup(
    lookup: PromptLookupDrafter | None, runs: Sequence[int], requests: list[DraftRequest]
) -> tuple[list[Proposal | None], list[DraftRequest]]:
    """Drafts by lookup for the requests whose sequence matched (`runs`: each one's match run class from
    `load_control.plan_depths`, 0 where the draft model drafts), None elsewhere; and the requests left
    for the draft model, lookup's at budget 0 (the model proposes nothing for them)."""
    hits = [lookup is not None and run > 0 for run in runs]
    found: list[Proposal | None] = [None] * len(requests)
    if lookup is not None and any(hits):
        mine = [i for i, hit in enumerate(hits) if hit]
        for i, p in zip(mine, lookup.propose([requests[i] for i in mine]), strict=True):
            found[i] = p
    return found, [replace(r, budget=0) if hit else r for r, hit in zip(requests, hits, strict=True)]


def searched(tokens: Sequence[int], prediction: Sequence[int], prompt_len: int) -> torch.Tensor:  # [T + P + 1 + L]
    """What lookup searches: a request's predicted output (`SamplingParams.prediction`) after the prompt's last
    MATCH_REACH tokens, then its sequence, whose end is the n-gram matched. The prediction is what the prompt is
    expected to be followed by: an output that begins as it does agrees with it for a whole run from its first
    token, a quote at once. A match in the prediction drafts the prediction's next tokens, as one in the prompt
    drafts the prompt's (a code edit's unchanged lines); one at the prediction's end drafts no further (`APART`)."""
    if not prediction:
        return torch.tensor(tokens, dtype=torch.long)
    tail = tokens[max(prompt_len - MATCH_REACH, 0) : prompt_len]
    return torch.tensor([*tail, *prediction, APART, *tokens], dtype=torch.long)


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
            seq = searched(req.tokens, req.params.prediction, req.prompt_len)
            draft = lookup_continuation(seq, self.max_ngram, self.min_ngram, req.budget)
            out.append(behind_spine(req, Proposal(TokenTree.chain(req.tokens[-1], draft))))
        return out

    def match(
        self, tokens: Sequence[int], length: int, prediction: Sequence[int] = (), prompt_len: int = 0
    ) -> tuple[int, int]:
        """(the match's `run_class`, tokens a proposal of at most `length` would draft); (0, 0): no match.
        `prediction`, `prompt_len`: the sequence's predicted output and prompt length (`searched`)."""
        run, found = lookup_match(searched(tokens, prediction, prompt_len), self.max_ngram, self.min_ngram, length)
        return run_class(run), len(found)

    def release(self, seq_ids: list[str]) -> None:
        return None

    def cached_sequences(self) -> int:
        return 0  # stateless: every proposal reads the request's tokens
