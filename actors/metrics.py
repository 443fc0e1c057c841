"""Serving metrics on Ray's Prometheus endpoint (`ray.serve.metrics`, tagged with deployment/replica/application).

Names are permanent (dashboards depend on them). At the endpoint Ray prefixes every name with `ray_`
and gives a counter the suffix `_total` when its name lacks one (docs/metrics.md lists what a scrape
shows). Every metric carries `model_name`, the served model's name (front_door.served_model_name, else the
target model): vLLM's label, which Ray Serve LLM's dashboard filters every panel by.

vLLM's metrics as Ray Serve LLM exports them (`vllm:X` in vLLM, `vllm_X` here, `ray_vllm_X` at the endpoint):
- the request families in actors/vllm_metrics.py: num_requests_running / num_requests_waiting, prompt_tokens,
  generation_tokens, request_success{finished_reason}, request_prompt_tokens / request_generation_tokens,
  time_to_first_token_seconds, inter_token_latency_seconds, request_time_per_output_token_seconds,
  e2e_request_latency_seconds, request_queue_time_seconds, request_prefill_time_seconds,
  request_decode_time_seconds (router);
- vllm_kv_cache_usage_perc: a target replica's KV reservations over its KV budget (at 1 admission refuses:
  HTTP 429); vLLM's counts blocks in use, specserve reserves prompt + max_tokens at admission;
- vllm_spec_decode_*: the speculative-decoding counters below, under both names.

vLLM's speculative-decoding counters, under vLLM's names and semantics, each also under specserve's first name
for it without `vllm_` (`spec_decode_num_drafts` beside `vllm_spec_decode_num_drafts`):
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
- specserve_requests_total{finish_reason}: finished requests (stop, length, cancelled, error; vLLM's
  finished_reason says abort for cancelled);
- specserve_requests_rejected_total{reason}: requests refused for load (HTTP 429, gRPC RESOURCE_EXHAUSTED):
  max_active_sequences (the router holds as many) or kv_budget (the target replica's KV budget is reserved);
- specserve_acceptance_length: histogram per request of tokens committed per target step (>= 1),
  every step counted (the prefill's, with no draft, too; vLLM's counts draft rounds only);
  Ray exports a histogram's _sum from bucket midpoints, not the observed values, so the buckets
  are narrow and start with (0.99, 1] (plain decoding, midpoint 0.995): sum / count is the mean
  to within half a bucket;
- specserve_time_to_first_token_seconds, specserve_inter_token_latency_seconds (per token: a step's
  gap over its tokens; vLLM's is per step), specserve_request_tokens_per_second: latency and speed histograms;
- specserve_queue_depth: sequences active in the router replica;
- specserve_speculation_depth: mean draft depth of the last drafted micro-batch;
- specserve_replica_up: 1 per live router / draft / target replica (sum by deployment = replicas per pool);
- specserve_busy_fraction: the busy fraction a draft or target replica last reported to Serve's autoscaler
  (actors/scaling.py: a pool wants ceil(sum / target_busy) replicas); only where the pool autoscales;
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
from typing import TYPE_CHECKING, Any

from actors.scaling import BUSY_METRIC
from actors.vllm_metrics import VllmMetrics

if TYPE_CHECKING:
    from actors.records import Live

_SECONDS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]
MODEL_TAG = "model_name"


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


class Recorders:
    """Ray's metric classes, or no-ops outside Ray; each metric carries `model_name`, set once as a default tag."""

    def __init__(self, model_name: str) -> None:
        self.m = _ray_metrics()
        self.model = {MODEL_TAG: model_name}

    def _tagged(self, metric: Any) -> Any:
        metric.set_default_tags(dict(self.model))  # a copy: Serve adds its own tags to the dict it is given
        return metric

    def counter(self, name: str, doc: str, *tags: str) -> Any:
        return self._tagged(self.m.Counter(name, doc, tag_keys=(MODEL_TAG, *tags))) if self.m else _Null()

    def gauge(self, name: str, doc: str) -> Any:
        return self._tagged(self.m.Gauge(name, doc, tag_keys=(MODEL_TAG,))) if self.m else _Null()

    def histogram(self, name: str, doc: str, boundaries: list[float]) -> Any:
        if not self.m:
            return _Null()
        return self._tagged(self.m.Histogram(name, doc, boundaries=boundaries, tag_keys=(MODEL_TAG,)))


class _Twin:
    """One count under two names: vLLM's as Ray Serve LLM exports it (`vllm_` + name) and specserve's first
    name for it (no `vllm_`), kept for the dashboards and queries that read it."""

    def __init__(self, r: Recorders, name: str, doc: str, *tags: str) -> None:
        self.counters = (r.counter("vllm_" + name, doc, *tags), r.counter(name, doc, *tags))

    def inc(self, value: float, tags: dict[str, str] | None = None) -> None:
        for counter in self.counters:
            counter.inc(value, tags=tags)


class RouterMetrics:
    def __init__(self, model_name: str = "") -> None:
        r = Recorders(model_name)
        self.vllm = VllmMetrics(r)
        self.num_drafts = _Twin(r, "spec_decode_num_drafts", "Draft rounds: verify steps with a draft of >= 1 token.")
        self.num_draft_tokens = _Twin(r, "spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted = _Twin(r, "spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = _Twin(
            r, "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position (0 = first).", "position"
        )
        self.drafted = r.counter(
            "specserve_draft_tokens_total", "Draft tokens proposed, by depth (1 = first).", "position"
        )
        self.accepted = r.counter(
            "specserve_accepted_tokens_total", "Draft tokens accepted, by depth (1 = first).", "position"
        )
        self.generated = r.counter("specserve_generated_tokens_total", "Tokens sent to clients.")
        self.requests = r.counter("specserve_requests_total", "Finished requests.", "finish_reason")
        self.rejected = r.counter("specserve_requests_rejected_total", "Requests refused (HTTP 429).", "reason")
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

    def step(self, depths: tuple[int, ...], n_accepted: int, new_tokens: int, now: float, live: Live) -> None:
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
        if new_tokens:
            self._emitted(live, new_tokens, now)

    def _emitted(self, live: Live, new_tokens: int, now: float) -> None:
        """The step sent `new_tokens` to the client: the latencies since the request's last tokens."""
        self.generated.inc(new_tokens)
        self.vllm.emitted(live, new_tokens, now)
        if live.last_emit is None:
            self.ttft.observe(now - live.admitted)
            live.first_token = now
        else:
            self.itl.observe((now - live.last_emit) / new_tokens)
        live.last_emit = now

    def finished(self, live: Live, reason: str, now: float) -> None:
        """The request ended (stop, length: its own end; cancelled: its client left; error); once per request."""
        if live.ended:
            return
        live.ended = True
        self.requests.inc(1, tags={"finish_reason": reason})
        self.vllm.finished(live, reason, now)
        if live.seq.finish_reason is None:  # cut short: no acceptance or speed of a whole request
            return
        self.acceptance.observe(live.seq.stats.acceptance_length)
        if now > live.admitted:
            self.speed.observe(len(live.seq.output) / (now - live.admitted))

    def census(self, active: int, running: int, waiting: int) -> None:
        """Sequences active in the router, and the requests running and waiting (vLLM's, actors/vllm_metrics.py)."""
        self.queue.set(active)
        self.vllm.census(running, waiting)

    def refused(self, reason: str) -> None:
        """A request refused for load (HTTP 429): `max_active_sequences` or `kv_budget`."""
        self.rejected.inc(1, tags={"reason": reason})


class ReplicaMetrics:
    """What every router, draft and target replica records of itself (the deployment tag tells the pool)."""

    def __init__(self, model_name: str) -> None:
        r = Recorders(model_name)
        r.gauge("specserve_replica_up", "1 per live replica of a pool.").set(1)
        self._busy = r.gauge(BUSY_METRIC, "Busy fraction the replica last reported to Serve's autoscaler.")
        self._kv = r.gauge("vllm_kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")

    def busy(self, fraction: float) -> float:
        """The busy fraction a draft or target replica reports for autoscaling (actors/scaling.py), published."""
        self._busy.set(fraction)
        return fraction

    def kv(self, reserved: int, budget: int) -> None:
        """A target replica's KV reservations (actors/admission.py) over its budget: at 1, admission refuses."""
        self._kv.set(reserved / budget)
