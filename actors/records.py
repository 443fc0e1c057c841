"""What a router keeps of its streams and rounds: a sequence in flight with its client's queue
(`Live`), one round of one lane (`StepRecord`), and what a finished sequence reports (`usage`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from actors.wire import WireProposal, Work
from speculative.planning.sequence import Sequence
from speculative.rules.tree import TokenTree


@dataclass(eq=False)
class Live:
    """A sequence in flight: the router's state (the source of truth) and its client's queue."""

    seq: Sequence
    chunks: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)
    proposal: WireProposal | None = None  # drafted, not yet verified
    cancelled: bool = False
    admitted: float = field(default_factory=time.time)  # when the router took the request (vLLM's arrival)
    scheduled: float | None = None  # when its first verify call left (vLLM: it left the waiting queue)
    first_token: float | None = None  # when the client got its first tokens
    last_emit: float | None = None  # when the client last got tokens
    ended: bool = False  # its end is on the metrics (finished, failed or cancelled: counted once)
    draft_seen: int = 0  # tokens of it the draft pool was last sent (what a call's catch-up is counted from)

    def schedule(self, now: float) -> None:
        """A verify call carries it: the first one schedules it (its queue time ends, its prefill begins)."""
        if self.scheduled is None:
            self.scheduled = now


@dataclass(frozen=True)
class StepRecord:
    """One round of one lane, for the router's stats."""

    start: float
    end: float
    draft: Work | None
    verify: Work | None
    drafted_seqs: int
    verified_seqs: int
    tokens: int  # tokens committed
    draft_replica: str | None = None
    target_replica: str | None = None
    ahead: Work | None = None  # the pre-draft made beside this round's verify, if it answered in the round
    ahead_tried: int = 0  # sequences pre-drafted
    ahead_hits: int = 0  # of them, those whose pre-draft is the next round's proposal
    ahead_cut_hits: int = 0  # of the hits, those on a branch where the verdict cut the assumed path
    unverified: int = 0  # pre-drafted tokens that will never be verified (misses, other guesses)

    @property
    def draft_hidden(self) -> tuple[float, float]:
        """(draft compute seconds beside this round's verify, the rest): what overlap hid."""
        hidden = total = 0.0
        for w in (self.draft, self.ahead):
            if w is None:
                continue
            total += w.seconds
            if self.verify is not None:
                hidden += max(min(w.end, self.verify.end) - max(w.start, self.verify.start), 0.0)
        return hidden, total - hidden

    @property
    def overhead(self) -> float:
        """Seconds of the round in neither draft nor target compute (Ray hops, Python, waiting)."""
        works = (self.draft, self.verify, self.ahead)
        spans = sorted((max(w.start, self.start), min(w.end, self.end)) for w in works if w)
        covered, reach = 0.0, self.start
        for lo, hi in spans:
            lo = max(lo, reach)
            if hi > lo:
                covered, reach = covered + hi - lo, hi
        return max(self.end - self.start - covered, 0.0)


def bare_proposal(seq: Sequence) -> WireProposal:
    """No draft: the tree of the sequence's last token alone (verifying it prefills and yields one token)."""
    return WireProposal(TokenTree.chain(seq.tokens[-1], []), None)


def usage(seq: Sequence) -> dict[str, Any]:
    return {
        "prompt_tokens": len(seq.prompt),
        "completion_tokens": len(seq.output),
        "steps": seq.stats.steps,
        "drafts": seq.stats.drafts,
        "drafted": seq.stats.drafted,
        "accepted": seq.stats.accepted,
        "acceptance_length": seq.stats.acceptance_length,
        "acceptance_histogram": list(seq.stats.histogram),
        "spec_tokens": seq.stats.spec_tokens,
    }


def with_logprobs(chunk: dict[str, Any], seq: Sequence, new: int) -> dict[str, Any]:
    """The chunk with its `new` tokens' log probabilities, when the request asked for them:
    `logprobs`: per token {"token", "logprob", "top": [[id, logprob], ...]} (plain data for the wire)."""
    if seq.params.logprobs is None:
        return chunk
    found = seq.logprobs[len(seq.logprobs) - new :] if new else []
    chunk["logprobs"] = [{"token": lp.token, "logprob": lp.logprob, "top": [list(p) for p in lp.top]} for lp in found]
    return chunk
