"""What crosses a Ray hop: proposals with sparse draft distributions, and timed results.

`Proposal.draft_probs` is dense `[n+1, V]`; with top-k / top-p sampling most of each row is zero,
and a dense row of a 151k vocabulary is 600 kB. `SparseProbs` carries the nonzeros as CSR
(`row_ptr`, `ids`, `probs`), which is exact: the acceptance rules only ever read q at tokens and
the residual `max(p - q, 0)`, both unchanged by dropping zeros. Rows that are mostly nonzero
(plain temperature sampling) are cheaper dense, so the encoder picks whichever is smaller.

Every worker result carries the wall-clock interval of its compute (`Work`), which the router
uses to split a step's time into draft, target and its own overhead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from speculative.drafters.base import Proposal
from speculative.rules.acceptance import Verdict
from speculative.rules.sampling import SamplingParams
from speculative.rules.tree import TokenTree
from speculative.target import VerifyItem


@dataclass(frozen=True)
class SparseProbs:
    """A `[rows, vocab]` probability table: CSR when sparse, else the dense tensor."""

    vocab: int
    dense: torch.Tensor | None  # [rows, vocab] float32, or None when sparse
    row_ptr: torch.Tensor | None  # [rows + 1] int64 offsets into ids / probs
    ids: torch.Tensor | None  # [nnz] int32
    probs: torch.Tensor | None  # [nnz] float32

    @staticmethod
    def encode(table: torch.Tensor) -> SparseProbs:  # table: [rows, vocab]
        rows, vocab = table.shape
        nonzero = table != 0  # [rows, vocab]
        nnz = int(nonzero.sum())
        if 2 * nnz >= rows * vocab:  # ids + probs would outweigh the dense table
            return SparseProbs(vocab, table.float().contiguous(), None, None, None)
        r, c = nonzero.nonzero(as_tuple=True)  # row-major, so each row's entries are contiguous
        counts = torch.bincount(r, minlength=rows)  # [rows]
        row_ptr = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
        return SparseProbs(vocab, None, row_ptr, c.to(torch.int32), table[r, c].float())

    def decode(self) -> torch.Tensor:  # [rows, vocab] float32
        if self.dense is not None:
            return self.dense
        assert self.row_ptr is not None and self.ids is not None and self.probs is not None
        rows = self.row_ptr.numel() - 1
        out = torch.zeros(rows, self.vocab)
        row_of = torch.repeat_interleave(torch.arange(rows), self.row_ptr.diff())  # [nnz]
        out[row_of, self.ids.long()] = self.probs
        return out


@dataclass(frozen=True)
class WireProposal:
    """A `Proposal` as sent between actors."""

    tree: TokenTree
    draft_probs: SparseProbs | None

    @staticmethod
    def encode(proposal: Proposal) -> WireProposal:
        probs = proposal.draft_probs
        return WireProposal(proposal.tree, None if probs is None else SparseProbs.encode(probs))

    def decode(self) -> Proposal:
        return Proposal(self.tree, None if self.draft_probs is None else self.draft_probs.decode())


@dataclass(frozen=True)
class Work:
    """When a worker computed, in `time.time()` seconds (same clock on one machine), over how many tokens
    where it ran a forward (a verify's: every row's tree and prompt chunk), and whether a verify ran crowded."""

    start: float
    end: float
    tokens: int = 0
    crowded: bool = False  # a verify on fewer cores than its replica borrows when alone: a draft call ran beside it

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Stopwatch:
    """`with Stopwatch() as sw: ...` then `sw.work`."""

    def __enter__(self) -> Stopwatch:
        self._start = time.time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.work = Work(self._start, time.time())


@dataclass(frozen=True)
class Drafted:
    """A draft replica's answer to one propose call."""

    proposals: list[WireProposal]
    work: Work
    replica: str  # which draft replica answered (affinity shows in the router's stats)


@dataclass(frozen=True)
class Verified:
    """A target replica's answer to one verify call."""

    verdicts: list[Verdict]
    work: Work
    waiting: int  # verify calls queued behind this one at the replica when it finished
    replica: str  # which target replica answered


@dataclass(frozen=True)
class TargetInfo:
    """What the router needs to know about the target model and a replica of it."""

    vocab_size: int
    eos_ids: frozenset[int]
    model: str
    max_model_len: int  # the model's own window (max_position_embeddings)
    kv_budget_tokens: int  # KV tokens the replica holds over all its sequences (speculative/engine/kv_budget.py)
    kv_budget_bytes: int  # most bytes a shard's runners' KV buffers hold together: its pool (engine/kv_pool.py)


@dataclass(frozen=True)
class DraftInfo:
    """A draft replica's limits; both None for drafters without a model (they hold no KV)."""

    max_model_len: int | None
    kv_budget_tokens: int | None


@dataclass(frozen=True)
class Reserved:
    """A target replica's answer to a KV reservation (actors/admission.py `KvLedger.reserve`)."""

    granted: bool
    held: int  # tokens reserved on the replica after the call
    budget: int  # the replica's kv_budget_tokens
    replica: str


@dataclass(frozen=True)
class WireVerifyItem:
    """A `VerifyItem` as sent to the target: the proposal in wire form."""

    seq_id: str
    tokens: tuple[int, ...]
    params: SamplingParams
    proposal: WireProposal
    # KV tokens reserved for the sequence (prompt + max_tokens): a replica not holding its reservation
    # (the lane moved here, or this replica replaced the one that granted it) takes it over.
    reserved: int = 0
    prompt_len: int = 0  # how many of `tokens` are the prompt

    def decode(self) -> VerifyItem:
        return VerifyItem(self.seq_id, self.tokens, self.params, self.proposal.decode(), self.prompt_len)
