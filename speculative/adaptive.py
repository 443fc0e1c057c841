"""Adaptive speculation length: each sequence drafts as deep as its recent acceptance pays for.

With per-token acceptance rate a, a chain of k draft tokens commits (1 - a^(k+1)) / (1 - a)
tokens per step and costs about 1 + verify_overhead + draft_cost * k target-steps. The chosen k
maximises their ratio; k = 0 is plain decoding. A sequence at k = 0 probes with k = 1 every
`probe_every` steps, so it can find its way back when the text becomes predictable. The choice
depends only on the sequence's own acceptance history, never on timing or the batch, so seeded
runs reproduce and a batch gives the same tokens as its sequences alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field


class AdaptiveConfig(BaseModel):
    """How speculation length follows acceptance."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="False: always draft max_depth tokens.")
    max_depth: int = Field(4, ge=0, le=64, description="Most draft tokens along any path.")
    draft_cost: float = Field(
        0.35, ge=0.0, le=10.0, description="One draft forward in target-forward units (0 for prompt lookup)."
    )
    verify_overhead: float = Field(
        0.1, ge=0.0, le=10.0, description="Extra cost of a multi-token verify over a 1-token decode."
    )
    prior_acceptance: float = Field(0.7, gt=0.0, lt=1.0, description="Acceptance assumed before any evidence.")
    memory: float = Field(0.8, gt=0.0, lt=1.0, description="Weight kept by old evidence at each step.")
    probe_every: int = Field(8, ge=1, le=10_000, description="Steps between k=1 probes while at k=0.")


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


def best_depth(acceptance: float, config: AdaptiveConfig) -> int:
    """The k in 0..max_depth with the most tokens per unit of cost."""

    def rate(k: int) -> float:
        cost = 1.0 + (config.verify_overhead + config.draft_cost * k if k else 0.0)
        return expected_tokens(acceptance, k) / cost

    return max(range(config.max_depth + 1), key=lambda k: (rate(k), -k))


@dataclass
class AdaptiveDepth:
    """One sequence's acceptance estimate and the speculation depth it implies."""

    config: AdaptiveConfig
    accepted: float = 0.0  # decayed count of accepted draft tokens (evidence only)
    trials: float = 0.0  # decayed count of accept/reject decisions (evidence only)
    prior_weight: float = 4.0  # pseudo-decisions of the prior, decaying like the evidence
    steps_at_zero: int = 0

    @property
    def acceptance(self) -> float:
        """The estimate under the configured prior: what this sequence's own depth follows."""
        return self.acceptance_with(self.config.prior_acceptance)

    def acceptance_with(self, prior: float) -> float:
        """The estimate with this prior in place of the configured one (e.g. what the lane has seen)."""
        estimate = (self.accepted + self.prior_weight * prior) / (self.trials + self.prior_weight)
        return min(max(estimate, 1e-3), 0.999)

    def next_depth(self) -> int:
        if not self.config.enabled:
            return self.config.max_depth
        k = best_depth(self.acceptance, self.config)
        if k == 0:
            self.steps_at_zero += 1
            if self.steps_at_zero >= self.config.probe_every:
                self.steps_at_zero = 0
                return 1
        return k

    def update(self, proposed_depth: int, accepted_depth: int) -> None:
        """Record a step: `accepted_depth` of `proposed_depth` draft levels kept."""
        if proposed_depth == 0:
            return
        memory = self.config.memory
        self.accepted, self.trials = tally(self.accepted, self.trials, memory, proposed_depth, accepted_depth)
        self.prior_weight *= self.config.memory
