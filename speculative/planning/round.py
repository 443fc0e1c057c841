"""One round of speculative decoding, the code the in-process decoder and the router's lanes share.

    plan     a row per sequence (`rows.DraftRow`), depths for them from the one depth controller
             (`load_control.plan_depths`), recorded on the sequences; draft requests; prompt
             lookup's drafts found here (they cost nothing to find)
    propose  the rest by the drafter: the decoder calls it in-process, a lane awaits its draft pool;
             `drafted` observes what that cost
    verify   the target's batched forward: in-process, or awaited from the target pool
    settle   costs observed, each verdict committed (acceptance evidence, output, stop)

`Speculation` holds what the steps need (the depth config, the measured costs, the lookup) and
nothing of the round in flight, so a lane can have two rounds in flight (ping-pong, round ahead).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

from speculative.drafters.base import DraftRequest, Proposal
from speculative.drafters.lookup import PromptLookupDrafter, split_lookup
from speculative.planning.costs import Planned, StepCosts, verify_tokens
from speculative.planning.depth import DepthConfig
from speculative.planning.load_control import Plan, plan_depths
from speculative.planning.rows import RoundShape, draft_rows
from speculative.planning.sequence import Sequence
from speculative.rules.logprobs import TokenLogprob
from speculative.rules.tree import TokenTree


class VerdictLike(Protocol):
    """What settling reads of a verdict (`verify.Verdict` in-process, its wire form from the pool)."""

    @property
    def tokens(self) -> tuple[int, ...]: ...  # committed tokens; () while the prompt is still prefilling

    @property
    def accepted(self) -> tuple[int, ...]: ...  # the accepted draft nodes

    @property
    def logprobs(self) -> tuple[TokenLogprob, ...] | None: ...  # per token, when the request asks


@dataclass(frozen=True)
class Drafting:
    """A planned round's drafts: those lookup found here and the requests left for the drafter."""

    plan: Plan
    found: list[Proposal | None]  # [n] drafted by prompt lookup here; None: the drafter's
    modelled: list[DraftRequest]  # [n] for the drafter (budget 0 where lookup drafted)

    @property
    def calls_drafter(self) -> bool:
        return any(r.budget for r in self.modelled)


@dataclass
class Speculation:
    """Plan, observe and settle rounds for one decoder or one router's lanes."""

    config: DepthConfig
    costs: StepCosts | None = None  # measured costs; None: unmeasured, depth by acceptance alone
    drafts_sampled: bool = True  # the drafter samples under sampling: such sequences' depths ignore load
    lookup: PromptLookupDrafter | None = None  # prompt lookup drafted here: the drafter, or quotes beside one
    lookup_quotes: bool = False  # `lookup` sits beside a draft model and drafts only quoting sequences
    eos_ids: frozenset[int] = frozenset()
    decode: Callable[[list[int]], str] | None = None
    free_drafts: bool = False  # drafts cost nothing to make (Medusa heads' guesses, made inside the verify)

    def depths(
        self, seqs: Seq[Sequence], batch: int, queued: int = 0, overlapped: bool = False, extra_levels: int = 0
    ) -> Plan:
        """The plan for `seqs` in a micro-batch of `batch` with `queued` verify calls waiting (pure);
        `extra_levels`: draft forwards beyond the depth (a pre-draft's guess of the bonus token). Priced by
        the measured costs where `config.load_adaptive` (not sequences whose tokens depend on depth)."""
        shape = RoundShape.of(self.config, batch, queued, overlapped, extra_levels)
        priced = self.costs if self.config.load_adaptive else None
        return plan_depths(draft_rows(seqs, shape, self, priced), shape, priced)

    def verify_seconds(self, seqs: Seq[Sequence], trees: Seq[TokenTree]) -> float | None:
        """A verify's predicted seconds over `seqs` with these trees, a draft call beside it (None: none measured
        yet)."""
        if self.costs is None:
            return None
        return self.costs.verify_beside(verify_tokens(seqs, trees))

    def plan(self, seqs: Seq[Sequence], batch: int, queued: int = 0, overlapped: bool = False) -> Drafting:
        """Plan this round, record it on the sequences, and draft what lookup finds."""
        plan = self.depths(seqs, batch, queued, overlapped)
        self.record(seqs, plan)
        requests = [
            DraftRequest(s.seq_id, tuple(s.tokens), row.depth, s.params, len(s.prompt))
            for s, row in zip(seqs, plan.rows, strict=True)
        ]
        found, modelled = split_lookup(self.lookup, [row.run for row in plan.rows], requests)
        return Drafting(plan, found, modelled)

    def record(self, seqs: Seq[Sequence], plan: Plan) -> None:
        """The round drafts as planned: which drafter each sequence's verdict is tallied by, and what the draft
        model has seen of those it drafts (what `catch_up` counts from; a quote beside it: nothing)."""
        for seq, row in zip(seqs, plan.rows, strict=True):
            seq.stats.record_drafter(row.run)
            if row.depth and not (row.run and self.lookup_quotes):
                seq.stats.record_model_draft(len(seq.tokens), row.catch_up)

    def drafted(self, seqs: Seq[Sequence], trees: Seq[TokenTree], seconds: float, planned: Planned | None) -> None:
        """The drafter's call for these sequences took `seconds` as the round waited for it."""
        if self.costs is not None:
            self.costs.observe_draft(seqs, trees, seconds, planned)

    def settle(
        self,
        seqs: Seq[Sequence],
        trees: Seq[TokenTree],  # [n] the tree each sequence was verified with (a bare root: no draft)
        verdicts: Seq[VerdictLike],
        seconds: float,
        planned: Planned | None,
        crowded: bool = False,
    ) -> list[list[int] | None]:
        """Observe the verify and commit each verdict: per sequence its new tokens, None while prefilling.
        `crowded`: the verify ran on fewer cores, a draft call beside it (`StepCosts.beside`).

        A round carrying a chunk of a long prefill (a sequence with no tokens yet) is not a sample of
        what a round costs, so it is not observed."""
        if self.costs is not None and all(v.tokens for v in verdicts):
            self.costs.observe_verify(seqs, trees, seconds, [len(v.accepted) for v in verdicts], crowded)
            self.costs.observe_round(planned, sum(len(v.tokens) for v in verdicts))
        out: list[list[int] | None] = []
        for seq, tree, verdict in zip(seqs, trees, verdicts, strict=True):
            if not verdict.tokens:  # still prefilling (chunked prefill): sent again next round
                out.append(None)
                continue
            kept = len(verdict.accepted)
            if not (seq.stats.lookup_run and self.lookup_quotes):  # beside a model: its evidence alone (quotes apart)
                seq.acceptance.update(max(tree.depths), kept, self.config.memory)
            out.append(seq.commit(tree, verdict.tokens, kept, self.eos_ids, self.decode, verdict.logprobs))
        return out
