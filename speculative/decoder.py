"""The speculative decoding loop: draft, verify, commit, for a batch of sequences.

`SpeculativeDecoder.step()` is one round for every active sequence, the round of `round.py` run
in-process (the router's lanes run the same round against their pools): the drafter proposes a
tree per sequence, the target verifies all trees in one batched forward, each verdict is
committed to the target's cache, and stop conditions end sequences. New sequences join and
finished ones leave between steps (continuous batching). Runs with no drafter as plain decoding.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from speculative.drafters.base import Drafter, Proposal, empty_proposal
from speculative.drafters.lookup import PromptLookupDrafter
from speculative.planning.costs import StepCosts
from speculative.planning.depth import DepthConfig
from speculative.planning.round import Drafting, Speculation
from speculative.planning.sequence import Sequence
from speculative.rules.sampling import SamplingParams
from speculative.target import TargetVerifier, VerifyItem


@dataclass
class StepTimes:
    """Wall time of the decoder's phases, summed over steps (seconds)."""

    steps: int = 0
    draft: float = 0.0  # drafter.propose
    verify: float = 0.0  # the target's batched forward + acceptance + commit
    total: float = 0.0  # whole steps, bookkeeping included


@dataclass(frozen=True)
class StepOutput:
    seq_id: str
    new_tokens: list[int]
    finish_reason: str | None


@dataclass(frozen=True)
class Planning:
    """How the decoder prices its depths beyond its depth config: measured costs, and what the planner must
    know of the drafter."""

    costs: StepCosts | None = None  # measure verify and draft costs and cap depths by them (load_control.py,
    # with `depth.load_adaptive`); None: depth by acceptance alone
    drafts_sampled: bool = True  # the drafter samples under sampling: sampled requests keep their acceptance-only
    # depth (reproducible tokens)
    lookup_quotes: PromptLookupDrafter | None = None  # beside a draft model, sequences quoting their context draft
    # by this lookup instead (`DrafterConfig.lookup_quotes`)


class SpeculativeDecoder:
    """Owns the target runner's rows; the router of one target replica in miniature."""

    def __init__(
        self,
        target: TargetVerifier,
        drafter: Drafter | None,
        depth: DepthConfig,
        eos_ids: frozenset[int] = frozenset(),
        decode: Callable[[list[int]], str] | None = None,
        planning: Planning | None = None,
    ) -> None:
        """`planning`: measured costs and the drafter's facts the load planner weighs (None: `Planning()`,
        depth by acceptance alone)."""
        planning = planning or Planning()
        self.target = target
        self.drafter = drafter
        self.depth = depth if drafter is not None else depth.model_copy(update={"max_depth": 0})
        quotes = planning.lookup_quotes
        lookup = drafter if isinstance(drafter, PromptLookupDrafter) else quotes
        self.speculation = Speculation(
            self.depth, planning.costs, planning.drafts_sampled, lookup, quotes is not None, eos_ids, decode
        )
        self.active: dict[str, Sequence] = {}
        self._pending: list[Sequence] = []
        self._ids = itertools.count()
        self.finished: list[Sequence] = []  # done since the last generate() began
        self.times = StepTimes()

    def add(self, prompt: list[int], params: SamplingParams, seq_id: str | None = None) -> str:
        if not prompt:
            raise ValueError("prompt: must contain at least one token")
        if any(not 0 <= t < self.target.vocab_size for t in prompt):
            raise ValueError(f"prompt: token ids must be in 0..{self.target.vocab_size - 1}")
        seq_id = seq_id or f"seq-{next(self._ids)}"
        if seq_id in self.active or any(s.seq_id == seq_id for s in self._pending):
            raise ValueError(f"sequence id {seq_id!r} is already running")
        self._pending.append(Sequence(seq_id, list(prompt), params))
        return seq_id

    def cancel(self, seq_id: str) -> None:
        self._pending = [s for s in self._pending if s.seq_id != seq_id]
        if seq_id in self.active:
            self._finish([self.active.pop(seq_id)])

    @property
    def has_work(self) -> bool:
        return bool(self.active or self._pending)

    def step(self) -> list[StepOutput]:
        """One plan-propose-verify-settle round; new sequences are prefilled inside the verify forward."""
        self.active.update((s.seq_id, s) for s in self._pending)
        self._pending = []
        if not self.active:
            return []
        t0 = time.perf_counter()
        seqs = list(self.active.values())
        drafting = self.speculation.plan(seqs, len(seqs))
        proposals = self._propose(drafting)
        t1 = time.perf_counter()
        if drafting.calls_drafter:
            self.speculation.drafted(seqs, [p.tree for p in proposals], t1 - t0, drafting.plan.predicted)
        pairs = zip(seqs, proposals, strict=True)
        items = [VerifyItem(s.seq_id, tuple(s.tokens), s.params, p, len(s.prompt)) for s, p in pairs]
        verdicts = self.target.verify(items)
        if errors := [f"{s.seq_id}: {v.error}" for s, v in zip(seqs, verdicts, strict=True) if v.error is not None]:
            raise ValueError(
                "; ".join(errors)
            )  # in process, a request's failure is the caller's (served: it alone ends)
        t2 = time.perf_counter()
        trees = [p.tree for p in proposals]
        news = self.speculation.settle(seqs, trees, verdicts, t2 - t1, drafting.plan.predicted)
        outputs = [StepOutput(s.seq_id, new or [], s.finish_reason) for s, new in zip(seqs, news, strict=True)]
        self._finish([s for s in seqs if s.finish_reason is not None])
        times = self.times
        times.steps += 1
        times.draft += t1 - t0
        times.verify += t2 - t1
        times.total += time.perf_counter() - t0
        return outputs

    def _propose(self, drafting: Drafting) -> list[Proposal]:
        if self.drafter is None:
            return [empty_proposal(r) for r in drafting.modelled]
        drafted = self.drafter.propose(drafting.modelled)
        return [p or q for p, q in zip(drafting.found, drafted, strict=True)]

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
