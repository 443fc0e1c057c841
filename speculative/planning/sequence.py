"""A sequence in flight: its tokens, sampling parameters, counters and acceptance evidence.

The planner's state on a sequence (what the draft model has seen of it, which drafter its verdicts are
tallied by, its lookup drafts' tally) is written only by `SequenceStats`'s own methods: the round records
its plan (`round.Speculation.plan`), a pre-draft what it sent (`actors/round_ahead.py`), settling the
lookup tally (`costs.StepCosts.observe_verify`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from speculative.planning.depth import Acceptance, tally
from speculative.rules.logprobs import TokenLogprob
from speculative.rules.sampling import SamplingParams
from speculative.rules.stopping import check_stop
from speculative.rules.tree import TokenTree


@dataclass
class SequenceStats:
    steps: int = 0  # target forwards (verify steps) this sequence took part in
    drafts: int = 0  # of them, steps with a draft of >= 1 token (vLLM's num_drafts)
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    draft_synced: int = 0  # tokens the sequence had when it last drafted (the draft model's cache since)
    drafted_at: int = -2  # `steps` when it last drafted
    draft_catch_up: int = 0  # at its last draft, committed tokens the draft model had not seen beyond a round's
    lookup_run: int = 0  # prompt lookup: the `run_class` of its last planned draft's match (0: none)
    lookup_tally: dict[int, tuple[float, float]] = field(default_factory=dict)  # n -> its (accepted, trials)
    histogram: list[int] = field(default_factory=list)  # [j]: steps with a draft whose verdict accepted j of it
    spec_tokens: int = 0  # the most draft tokens (tree nodes) one step proposed

    def record_drafter(self, run: int) -> None:
        """Its planned round drafts by a lookup match of run class `run` (0: not by lookup): what its verdict
        is tallied by."""
        self.lookup_run = run

    def record_model_draft(self, synced: int, catch_up: int) -> None:
        """The draft model drafts for it this round, having seen `synced` of its tokens after catching up on
        `catch_up` beyond a round's worth (what `costs.catch_up` counts from)."""
        self.draft_synced, self.drafted_at, self.draft_catch_up = synced, self.steps, catch_up

    def tally_lookup(self, run: int, proposed: int, kept: int, memory: float) -> None:
        """A verdict on its lookup draft of `proposed` tokens from a run-class-`run` match kept `kept`."""
        own = self.lookup_tally.get(run, (0.0, 0.0))
        self.lookup_tally[run] = tally(*own, memory, proposed, kept)

    @property
    def acceptance_length(self) -> float:
        """Tokens committed per target step, bonus included."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


@dataclass
class Sequence:
    seq_id: str
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text_end: int | None = None
    stats: SequenceStats = field(default_factory=SequenceStats)
    acceptance: Acceptance = field(default_factory=Acceptance)  # its drafts' decayed accept/reject evidence
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token, when params.logprobs is set

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
        logprobs: tuple[TokenLogprob, ...] | None = None,
    ) -> list[int]:
        """Record one verified step: stats, output (and `logprobs`, one per token) cut at a stop.
        Returns the new tokens."""
        drafted = tree.size if tree is not None else 0
        self.stats.steps += 1
        self.stats.drafts += int(drafted > 0)
        self.stats.drafted += drafted
        self.stats.accepted += n_accepted
        if drafted:
            self.stats.histogram += [0] * (n_accepted + 1 - len(self.stats.histogram))
            self.stats.histogram[n_accepted] += 1
            self.stats.spec_tokens = max(self.stats.spec_tokens, drafted)
        before = len(self.output)
        self.output += tokens
        stop = check_stop(self.output, len(tokens), self.params, eos_ids, decode)
        del self.output[stop.keep :]
        if logprobs is not None:
            self.logprobs += logprobs
            del self.logprobs[stop.keep :]
        self.finish_reason, self.text_end = stop.reason, stop.text_end
        return self.output[before:]
