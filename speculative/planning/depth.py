"""The depth controller's knobs and its per-sequence rule: how deep each sequence would draft alone.

One controller sets every draft depth: `DepthConfig` holds all its knobs, `own_depth` is a
sequence's depth from its own acceptance, `depth_cap` bounds it by the batch and the target's
queue, and `load_control.plan_depths` weighs those against the measured costs of the round
(`StepCosts`) and returns the plan. Once costs are measured, a sequence whose tokens do not
depend on depth (greedy, deterministic drafts) is bounded by them instead of by `own_depth`'s
fixed cost model: a draft hidden behind the verify costs less than that model says. All of
them are pure functions of their arguments; what a round observes is recorded by
`round.Speculation` when the round settles.

With per-token acceptance rate a, a chain of k draft tokens commits (1 - a^(k+1)) / (1 - a)
tokens per step and costs about 1 + verify_overhead + draft_cost * k target-steps before any
cost is measured. The chosen k maximises their ratio; k = 0 is plain decoding. A sequence at
k = 0 that has not drafted for `probe_every` rounds probes with k = 1, so it can find its way
back when the text becomes predictable. This rule depends only on the sequence's own history,
never on timing or the batch, so seeded runs reproduce and a batch gives the same tokens as its
sequences alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field


class DepthConfig(BaseModel):
    """How deep sequences draft: per sequence by acceptance, per batch by size, queue and measured cost."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_depth: int = Field(4, ge=0, le=64, description="Most draft tokens along any path.")
    max_quote_depth: int = Field(
        24,
        ge=0,
        le=64,
        description="Most draft tokens of a quote: prompt lookup's draft where the text agrees with an earlier "
        "passage for 8 or more tokens (copied code, a repeated list). A quote costs nothing to draft and lands "
        "far more often than a draft model's guess, so it may run deeper than max_depth (the measured verify "
        "cost still chooses how deep; verify_token_budget still bounds the batch).",
    )
    adaptive: bool = Field(True, description="Depth follows each sequence's acceptance; False: always max_depth.")
    prior_acceptance: float = Field(0.7, gt=0.0, lt=1.0, description="Acceptance assumed before any evidence.")
    memory: float = Field(0.8, gt=0.0, lt=1.0, description="Weight a sequence's old evidence keeps at each step.")
    probe_every: int = Field(8, ge=1, le=10_000, description="Rounds at depth 0 before a 1-token probe.")
    draft_cost: float = Field(
        0.35, ge=0.0, le=10.0, description="One draft forward in target-forward units, before costs are measured."
    )
    verify_overhead: float = Field(
        0.1, ge=0.0, le=10.0, description="Extra cost of a multi-token verify over a 1-token decode, likewise."
    )
    verify_token_budget: int = Field(
        64,
        ge=1,
        le=65_536,
        description="Most tree nodes one verify forward should carry; beyond it depths shrink, since each "
        "token past the 'free' region of a forward costs as much as decoding it.",
    )
    shrink_when_queued: bool = Field(
        True, description="Halve the depth cap for each verify call queued at the target (saturation -> k=0)."
    )
    load_adaptive: bool = Field(
        True,
        description="Choose each round's depths for the most expected tokens/s from the measured verify and draft "
        "costs (speculative/planning/load_control.py); all 0 (plain decoding) when speculation does not pay at this "
        "load.",
    )
    cost_memory: float = Field(
        0.7, gt=0.0, lt=1.0, description="Weight an old cost measurement keeps at each new one of its size."
    )
    refresh_rounds: int = Field(
        64, ge=1, le=100_000, description="Re-measure a plain round of the current size after this many verifies."
    )
    min_gain: float = Field(
        1.1, ge=1.0, le=10.0, description="Drafted tokens count at 1/min_gain of their expected number (a margin)."
    )
    lookup_min_gain: float = Field(
        2.0, ge=1.0, le=10.0, description="The same for prompt lookup's drafts from short (chance) matches."
    )
    probe_cost: float = Field(
        0.03, ge=0.0, le=1.0, description="A probe round may cost this much more than the round it replaces."
    )
    probe_hope: float = Field(
        0.9, gt=0.0, lt=1.0, description="A probe looks for drafts this good: none where even they would not pay."
    )
    calibration_memory: float = Field(
        0.8, gt=0.0, lt=1.0, description="Weight the old delivered/expected calibration keeps per drafting round."
    )
    calibration_relax: float = Field(
        0.005, ge=0.0, le=1.0, description="Per plain round, the calibrations move this far back toward 1."
    )
    pooled_memory: float = Field(
        0.98, gt=0.0, lt=1.0, description="Weight an old accept/reject decision keeps in the lane-wide acceptance."
    )


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens committed per step by a chain of k with per-token acceptance `acceptance`."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def tally(accepted: float, trials: float, memory: float, proposed: int, kept: int) -> tuple[float, float]:
    """Decayed (accepted, trials) after a step that kept `kept` of `proposed` draft levels: each kept
    level is an accepted decision, the first rejected one (if any) a rejected one."""
    rejected = 1.0 if kept < proposed else 0.0
    return memory * accepted + kept, memory * trials + kept + rejected


def best_depth(acceptance: float, config: DepthConfig) -> int:
    """The k in 0..max_depth with the most tokens per unit of cost (the unmeasured cost model)."""

    def rate(k: int) -> float:
        cost = 1.0 + (config.verify_overhead + config.draft_cost * k if k else 0.0)
        return expected_tokens(acceptance, k) / cost

    return max(range(config.max_depth + 1), key=lambda k: (rate(k), -k))


@dataclass
class Acceptance:
    """One sequence's decayed accept/reject evidence (updated when its rounds settle)."""

    accepted: float = 0.0  # decayed count of accepted draft tokens
    trials: float = 0.0  # decayed count of accept/reject decisions
    prior_weight: float = 4.0  # pseudo-decisions of the prior, decaying like the evidence

    def estimate(self, prior: float) -> float:
        """The acceptance rate, leaning on `prior` while evidence is scarce."""
        estimate = (self.accepted + self.prior_weight * prior) / (self.trials + self.prior_weight)
        return min(max(estimate, 1e-3), 0.999)

    def update(self, proposed_depth: int, accepted_depth: int, memory: float) -> None:
        """Record a step: `accepted_depth` of `proposed_depth` draft levels kept."""
        if proposed_depth == 0:
            return
        self.accepted, self.trials = tally(self.accepted, self.trials, memory, proposed_depth, accepted_depth)
        self.prior_weight *= memory


def own_depth(acceptance: Acceptance, rounds_since_drafted: int, config: DepthConfig) -> int:
    """How deep a sequence drafts by its own evidence alone (a probe of 1 after probe_every rounds at 0)."""
    if not config.adaptive:
        return config.max_depth
    k = best_depth(acceptance.estimate(config.prior_acceptance), config)
    return 1 if k == 0 and config.max_depth and rounds_since_drafted >= config.probe_every else k


def depth_cap(config: DepthConfig, batch: int, queued: int, quote: bool = False) -> int:
    """Most draft tokens per sequence in a micro-batch of `batch` while `queued` verify calls wait at the
    target (of a `quote`: `max_quote_depth`): the token budget shared by the batch, halved for each queued
    call."""
    deepest = config.max_quote_depth if quote else config.max_depth
    cap = min(deepest, max(config.verify_token_budget // max(batch, 1) - 1, 0))
    return cap >> queued if config.shrink_when_queued else cap
