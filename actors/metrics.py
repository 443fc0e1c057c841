"""Serving metrics on Ray's Prometheus endpoint (`ray.serve.metrics`, tagged with deployment/replica).

Names are permanent (dashboards depend on them). At the endpoint Ray prefixes every name with `ray_`
and gives a counter the suffix `_total` when its name lacks one (docs/metrics.md lists what a scrape
shows).

vLLM's speculative-decoding counters, under vLLM's names and semantics (`vllm:spec_decode_*` there):
- spec_decode_num_drafts: draft rounds, i.e. verify steps in which a sequence had a draft of >= 1 token;
- spec_decode_num_draft_tokens: draft tokens proposed to the target (for a tree, every node);
- spec_decode_num_accepted_tokens: draft tokens the target accepted;
- spec_decode_num_accepted_tokens_per_pos{position}: accepted draft tokens by position, 0-BASED:
  position 0 is the first draft token after the committed end (for a tree, the accepted path's
  depth index). Acceptance length, as vLLM computes it: 1 + accepted / drafts; per-position
  acceptance rate: accepted_per_pos / drafts.

specserve's own:
- specserve_draft_tokens_total{position}: draft tokens proposed to the target, by depth in the tree, 1-BASED
  (1 = the first draft token: vLLM's position 0);
- specserve_accepted_tokens_total{position}: draft tokens the target accepted, by depth, 1-BASED;
- specserve_generated_tokens_total: tokens sent to clients;
- specserve_requests_total{finish_reason}: finished requests (stop, length, cancelled, error);
- specserve_acceptance_length: histogram per request of tokens committed per target step (>= 1),
  every step counted (the prefill's, with no draft, too; vLLM's counts draft rounds only);
  Ray exports a histogram's _sum from bucket midpoints, not the observed values, so the buckets
  are narrow and start with (0.99, 1] (plain decoding, midpoint 0.995): sum / count is the mean
  to within half a bucket;
- specserve_time_to_first_token_seconds, specserve_inter_token_latency_seconds,
  specserve_request_tokens_per_second: latency and speed histograms;
- specserve_queue_depth: sequences active in the router replica;
- specserve_speculation_depth: mean draft depth of the last drafted micro-batch;
- specserve_replica_up: 1 per live router / draft / target replica (sum by deployment = replicas per pool);
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


class _Recorders:
    """Ray's metric classes, or no-ops outside Ray."""

    def __init__(self) -> None:
        self.m = _ray_metrics()

    def counter(self, name: str, doc: str, *tags: str) -> Any:
        return self.m.Counter(name, doc, tags) if self.m else _Null()

    def gauge(self, name: str, doc: str) -> Any:
        return self.m.Gauge(name, doc) if self.m else _Null()

    def histogram(self, name: str, doc: str, boundaries: list[float]) -> Any:
        return self.m.Histogram(name, doc, boundaries=boundaries) if self.m else _Null()


class RouterMetrics:
    def __init__(self) -> None:
        r = _Recorders()
        self.num_drafts = r.counter("spec_decode_num_drafts", "Draft rounds: verify steps with a draft of >= 1 token.")
        self.num_draft_tokens = r.counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted = r.counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = r.counter(
            "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position (0 = first).", "position"
        )
        self.drafted = r.counter(
            "specserve_draft_tokens_total", "Draft tokens proposed, by depth (1 = first).", "position"
        )
        self.accepted = r.counter(
            "specserve_accepted_tokens_total", "Draft tokens accepted, by depth (1 = first).", "position"
        )
        self.generated = r.counter("specserve_generated_tokens_total", "Tokens sent to clients.")
        self.requests = r.counter("specserve_requests_total", "Finished requests.", "finish_reason")
        self.acceptance = r.histogram(
            "specserve_acceptance_length",
            "Tokens committed per target step, per request.",
            [0.99, 1, 1.25, 1.5, 1.75, 2, 2.25, 2.5, 3, 3.5, 4, 5, 6, 8],
        )
        self.ttft = r.histogram("specserve_time_to_first_token_seconds", "Time to first token.", _SECONDS)
        self.itl = r.histogram("specserve_inter_token_latency_seconds", "Time between tokens.", _SECONDS)
        self.speed = r.histogram(
            "specserve_request_tokens_per_second",
            "Generated tokens per second, per request.",
            [0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
        )
        self.queue = r.gauge("specserve_queue_depth", "Sequences active in the router.")
        self.depth = r.gauge("specserve_speculation_depth", "Mean draft depth of the last micro-batch.")
        self.predraft = r.counter("specserve_predraft_sequences_total", "Sequences pre-drafted round ahead.", "outcome")
        self.unverified = r.counter("specserve_draft_tokens_unverified_total", "Draft tokens no verify will see.")
        self.draft_seconds = r.counter(
            "specserve_draft_seconds_total", "Draft compute seconds, hidden or not.", "hidden"
        )

    def ahead(self, tried: int, hits: int, outcome: str, unverified: int = 0) -> None:
        """A pre-draft of `tried` sequences ended: settled in its round (`hits` of them hit), or late."""
        if outcome == "late":
            if tried:  # (a catch-up call drafts for no sequence; Ray's counters refuse 0)
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
        by_depth = Tally(d for d in depths if d > 0)
        for depth, count in by_depth.items():
            self.drafted.inc(count, tags={"position": str(depth)})
        if by_depth:  # a draft round; a bare root (prefill, depth 0) is none
            self.num_drafts.inc(1)
            self.num_draft_tokens.inc(sum(by_depth.values()))
        if n_accepted:
            self.num_accepted.inc(n_accepted)
        for position in range(n_accepted):  # the accepted path: depth position + 1
            self.accepted_per_pos.inc(1, tags={"position": str(position)})
            self.accepted.inc(1, tags={"position": str(position + 1)})
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
    """A router, draft or target replica counts itself (the deployment tag tells the pool)."""
    _Recorders().gauge("specserve_replica_up", "1 per live replica of a pool.").set(1)
