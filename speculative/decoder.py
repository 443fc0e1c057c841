"""The speculative decoding loop: draft, verify, commit, for a batch of sequences.

`SpeculativeDecoder.step()` is one round for every active sequence: the drafter proposes a tree
per sequence, the target verifies all trees in one batched forward, each verdict is committed to
the target's cache, and stop conditions end sequences. New sequences join and finished ones
leave between steps (continuous batching). Runs with no drafter as plain decoding.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from speculative.adaptive import AdaptiveConfig, AdaptiveDepth
from speculative.drafters.base import Drafter, DraftRequest, Proposal, empty_proposal
from speculative.drafters.lookup import PromptLookupDrafter, split_lookup
from speculative.load_control import Planned, StepCosts, plan_depths
from speculative.sampling import SamplingParams
from speculative.stopping import check_stop
from speculative.target import TargetVerifier, VerifyItem
from speculative.tree import TokenTree


@dataclass
class SequenceStats:
    steps: int = 0  # target forwards (verify steps) this sequence took part in
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    draft_synced: int = 0  # tokens the sequence had when it last drafted (the draft model's cache since)
    drafted_at: int = -2  # `steps` when it last drafted
    draft_catch_up: int = 0  # at its last draft, committed tokens the draft model had not seen beyond a round's
    lookup_run: int = 0  # prompt lookup: the `run_class` of its last planned draft's match (0: none)
    lookup_tally: dict[int, tuple[float, float]] = field(default_factory=dict)  # n -> its (accepted, trials)

    @property
    def acceptance_length(self) -> float:
        """Tokens committed per target step, bonus included."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


@dataclass
class StepTimes:
    """Wall time of the decoder's phases, summed over steps (seconds)."""

    steps: int = 0
    draft: float = 0.0  # drafter.propose
    verify: float = 0.0  # the target's batched forward + acceptance + commit
    total: float = 0.0  # whole steps, bookkeeping included


@dataclass
class Sequence:
    seq_id: str
    prompt: list[int]
    params: SamplingParams
    depth: AdaptiveDepth
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text_end: int | None = None
    stats: SequenceStats = field(default_factory=SequenceStats)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def commit(
        self,
        tree: TokenTree | None,
        tokens: tuple[int, ...],
        n_accepted: int,
        eos_ids: frozenset[int],
        decode: Callable[[list[int]], str] | None,
    ) -> list[int]:
        """Record one verified step: stats, adaptive depth, output cut at a stop. Returns new tokens."""
        self.depth.update(max(tree.depths) if tree is not None else 0, n_accepted)
        self.stats.steps += 1
        self.stats.drafted += tree.size if tree is not None else 0
        self.stats.accepted += n_accepted
        before = len(self.output)
        self.output += tokens
        stop = check_stop(self.output, len(tokens), self.params, eos_ids, decode)
        del self.output[stop.keep :]
        self.finish_reason, self.text_end = stop.reason, stop.text_end
        return self.output[before:]


@dataclass(frozen=True)
class StepOutput:
    seq_id: str
    new_tokens: list[int]
    finish_reason: str | None


class SpeculativeDecoder:
    """Owns the target runner's rows; the router of one target replica in miniature."""

    def __init__(
        self,
        target: TargetVerifier,
        drafter: Drafter | None,
        adaptive: AdaptiveConfig,
        eos_ids: frozenset[int] = frozenset(),
        decode: Callable[[list[int]], str] | None = None,
        costs: StepCosts | None = None,
        drafts_sampled: bool = True,
        quotes: PromptLookupDrafter | None = None,
    ) -> None:
        """`costs`: measure verify and draft costs and cap depths by them (load_control.py); None: depth
        by acceptance alone. `drafts_sampled`: the drafter samples drafts under sampling, so sampled
        requests keep their acceptance-only depth (reproducible tokens). `quotes`: beside a draft model,
        sequences quoting their context draft by this lookup instead (`DrafterConfig.lookup_quotes`)."""
        self.target = target
        self.drafter = drafter
        self.adaptive = adaptive if drafter is not None else adaptive.model_copy(update={"max_depth": 0})
        self.eos_ids = eos_ids
        self.decode = decode
        self.active: dict[str, Sequence] = {}
        self._pending: list[Sequence] = []
        self._ids = itertools.count()
        self.finished: list[Sequence] = []  # done since the last generate() began
        self.times = StepTimes()
        self.costs = costs
        self.drafts_sampled = drafts_sampled
        self.quotes = quotes

    def add(self, prompt: list[int], params: SamplingParams, seq_id: str | None = None) -> str:
        if not prompt:
            raise ValueError("prompt: must contain at least one token")
        if any(not 0 <= t < self.target.vocab_size for t in prompt):
            raise ValueError(f"prompt: token ids must be in 0..{self.target.vocab_size - 1}")
        seq_id = seq_id or f"seq-{next(self._ids)}"
        if seq_id in self.active or any(s.seq_id == seq_id for s in self._pending):
            raise ValueError(f"sequence id {seq_id!r} is already running")
        self._pending.append(Sequence(seq_id, list(prompt), params, AdaptiveDepth(self.adaptive)))
        return seq_id

    def cancel(self, seq_id: str) -> None:
        self._pending = [s for s in self._pending if s.seq_id != seq_id]
        if seq_id in self.active:
            self._finish([self.active.pop(seq_id)])

    @property
    def has_work(self) -> bool:
        return bool(self.active or self._pending)

    def step(self) -> list[StepOutput]:
        """One draft-verify-commit round; new sequences are prefilled inside the verify forward."""
        self.active.update((s.seq_id, s) for s in self._pending)
        self._pending = []
        if not self.active:
            return []
        t0 = time.perf_counter()
        seqs = list(self.active.values())
        proposals = self._propose(seqs)
        t1 = time.perf_counter()
        items = [VerifyItem(s.seq_id, tuple(s.tokens), s.params, p) for s, p in zip(seqs, proposals, strict=True)]
        verdicts = self.target.verify(items)
        t2 = time.perf_counter()
        if self.costs is not None:
            predicted = self.costs.last_predicted
            self._observe(seqs, proposals, [len(v.accepted) for v in verdicts], t1 - t0, t2 - t1, predicted)
            self.costs.observe_round(predicted, sum(len(v.tokens) for v in verdicts))
        outputs = [
            self._commit(seq, prop, v.tokens, len(v.accepted))
            for seq, prop, v in zip(seqs, proposals, verdicts, strict=True)
        ]
        self._finish([s for s in seqs if s.finish_reason is not None])
        times = self.times
        times.steps += 1
        times.draft += t1 - t0
        times.verify += t2 - t1
        times.total += time.perf_counter() - t0
        return outputs

    def _propose(self, seqs: list[Sequence]) -> list[Proposal]:
        lookup = self.drafter if isinstance(self.drafter, PromptLookupDrafter) else self.quotes
        max_depth, sampled = self.adaptive.max_depth, self.drafts_sampled
        depths = plan_depths(seqs, self.costs, max_depth, False, sampled, lookup, self.quotes is not None)
        requests = [DraftRequest(s.seq_id, tuple(s.tokens), d, s.params) for s, d in zip(seqs, depths, strict=True)]
        if self.drafter is None:
            return [empty_proposal(r) for r in requests]
        found, modelled = split_lookup(lookup, [s.stats.lookup_run for s in seqs], requests)
        return [p or q for p, q in zip(found, self.drafter.propose(modelled), strict=True)]

    def _observe(
        self,
        seqs: list[Sequence],
        proposals: list[Proposal],
        accepted: list[int],
        draft_s: float,
        verify_s: float,
        planned: Planned | None,
    ) -> None:
        assert self.costs is not None
        self.costs.observe_draft(seqs, [p.tree for p in proposals], draft_s, planned)
        self.costs.observe_verify(seqs, [p.tree for p in proposals], verify_s, accepted)

    def _commit(self, seq: Sequence, prop: Proposal, tokens: tuple[int, ...], n_accepted: int) -> StepOutput:
        new = seq.commit(prop.tree, tokens, n_accepted, self.eos_ids, self.decode)
        return StepOutput(seq.seq_id, new, seq.finish_reason)

    def _finish(self, done: list[Sequence]) -> None:
        if not done:
            return
        for seq in done:
            self.active.pop(seq.seq_id, None)
        ids = [s.seq_id for s in done]
        self.target.release(ids)
        if self.drafter is not None:
            self.drafter.release(ids)
        self.finished.extend(done)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        """Run prompts to completion as one continuous batch; results in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        self.finished = []
        while self.has_work:
            self.step()
        by_id = {s.seq_id: s for s in self.finished}
        return [by_id[i] for i in ids]
