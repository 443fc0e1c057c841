"""Serving metrics on Ray's Prometheus endpoint (`ray.serve.metrics`, tagged with deployment/replica).

Names are permanent (dashboards depend on them):
- specserve_draft_tokens_total{position}: draft tokens proposed, by depth in the tree (1 = first);
- specserve_accepted_tokens_total{position}: draft tokens the target accepted, by depth;
- specserve_generated_tokens_total: tokens sent to clients;
- specserve_requests_total{finish_reason}: finished requests (stop, length, cancelled, error);
- specserve_acceptance_length: histogram per request of tokens committed per target step (>= 1);
  Ray exports a histogram's _sum from bucket midpoints, not the observed values, so the buckets
  are narrow and start with (0.99, 1] (plain decoding, midpoint 0.995): sum / count is the mean
  to within half a bucket;
- specserve_time_to_first_token_seconds, specserve_inter_token_latency_seconds,
  specserve_request_tokens_per_second: latency and speed histograms;
- specserve_queue_depth: sequences active in the router replica;
- specserve_speculation_depth: mean draft depth of the last drafted micro-batch;
- specserve_replica_up: 1 per live draft / target replica (sum by deployment = replicas per pool);
- specserve_predraft_sequences_total{outcome}: sequences pre-drafted round ahead (`actors/round_ahead.py`),
  by outcome: hit (the next round's proposal), miss (redrafted), late (answered after its round);
  hit rate = hit / (hit + miss + late);
- specserve_draft_tokens_unverified_total: draft tokens computed that no verify will see (missed
  pre-drafts, the guesses beside the one that hit);
- specserve_draft_seconds_total{hidden}: draft compute seconds, hidden ("true") behind a verify of
  the same lane or not ("false"); hidden share = true / (true + false).
Outside a Ray worker (plain-Python tests) every recorder is a no-op.
"""

from __future__ import annotations

from collections import Counter as Tally
from typing import Any

_SECONDS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]


class _Null:
    def inc(self, *args: Any, **kwargs: Any) -> None: ...
    def set(self, *args: Any, **kwargs: Any) -> None: ...
    def observe(self, *args: Any, **kwargs: Any) -> None: ...


def _ray_metrics() -> Any | None:
    import ray

    if not ray.is_initialized():
        return None
    from ray.serve import metrics

    return metrics


class RouterMetrics:
    def __init__(self) -> None:
        m = _ray_metrics()
        null = _Null()
        self.drafted = m.Counter("specserve_draft_tokens_total", "Draft tokens proposed.", ("position",)) if m else null
        self.accepted = (
            m.Counter("specserve_accepted_tokens_total", "Draft tokens accepted.", ("position",)) if m else null
        )
        self.generated = m.Counter("specserve_generated_tokens_total", "Tokens sent to clients.") if m else null
        self.requests = m.Counter("specserve_requests_total", "Finished requests.", ("finish_reason",)) if m else null
        self.acceptance = (
            m.Histogram(
                "specserve_acceptance_length",
                "Tokens committed per target step, per request.",
                boundaries=[0.99, 1, 1.25, 1.5, 1.75, 2, 2.25, 2.5, 3, 3.5, 4, 5, 6, 8],
            )
            if m
            else null
        )
        self.ttft = (
            m.Histogram("specserve_time_to_first_token_seconds", "Time to first token.", boundaries=_SECONDS)
            if m
            else null
        )
        self.itl = (
            m.Histogram("specserve_inter_token_latency_seconds", "Time between tokens.", boundaries=_SECONDS)
            if m
            else null
        )
        self.speed = (
            m.Histogram(
                "specserve_request_tokens_per_second",
                "Generated tokens per second, per request.",
                boundaries=[0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
            )
            if m
            else null
        )
        self.queue = m.Gauge("specserve_queue_depth", "Sequences active in the router.") if m else null
        self.depth = m.Gauge("specserve_speculation_depth", "Mean draft depth of the last micro-batch.") if m else null
        self.predraft = (
            m.Counter("specserve_predraft_sequences_total", "Sequences pre-drafted round ahead.", ("outcome",))
            if m
            else null
        )
        self.unverified = (
            m.Counter("specserve_draft_tokens_unverified_total", "Draft tokens no verify will see.") if m else null
        )
        self.draft_seconds = (
            m.Counter("specserve_draft_seconds_total", "Draft compute seconds, hidden or not.", ("hidden",))
            if m
            else null
        )

    def ahead(self, tried: int, hits: int, outcome: str, unverified: int = 0) -> None:
        """A pre-draft of `tried` sequences ended: settled in its round (`hits` of them hit), or late."""
        if outcome == "late":
            self.predraft.inc(tried, tags={"outcome": "late"})
            return
        if hits:
            self.predraft.inc(hits, tags={"outcome": "hit"})
        if tried - hits:
            self.predraft.inc(tried - hits, tags={"outcome": "miss"})
        if unverified:
            self.unverified.inc(unverified)

    def draft_time(self, hidden: float, exposed: float) -> None:
        """A round's draft compute: seconds beside a verify of the lane, and the rest."""
        if hidden > 0:
            self.draft_seconds.inc(hidden, tags={"hidden": "true"})
        if exposed > 0:
            self.draft_seconds.inc(exposed, tags={"hidden": "false"})

    def step(self, depths: tuple[int, ...], n_accepted: int, new_tokens: int, now: float, live: Any) -> None:
        """One verified step of one sequence; `depths`: the tree's node depths (root 0 included)."""
        for depth, count in Tally(d for d in depths if d > 0).items():
            self.drafted.inc(count, tags={"position": str(depth)})
        for position in range(1, n_accepted + 1):
            self.accepted.inc(1, tags={"position": str(position)})
        if not new_tokens:
            return
        self.generated.inc(new_tokens)
        if live.last_emit is None:
            self.ttft.observe(now - live.admitted)
        else:
            self.itl.observe((now - live.last_emit) / new_tokens)
        live.last_emit = now

    def finished(self, reason: str, acceptance_length: float, tokens: int, seconds: float) -> None:
        self.requests.inc(1, tags={"finish_reason": reason})
        if acceptance_length > 0:
            self.acceptance.observe(acceptance_length)
        if tokens and seconds > 0:
            self.speed.observe(tokens / seconds)


def mark_replica_up() -> None:
    """A draft or target replica counts itself (the deployment tag tells the pool)."""
    m = _ray_metrics()
    if m is not None:
        m.Gauge("specserve_replica_up", "1 per live replica of a pool.").set(1)
