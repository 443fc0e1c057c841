"""What the router and a target replica record of real requests under vLLM's names (in one process, Ray's metrics
faked: tests/ray_metrics.py): a request's moments (queue, prefill, decode, end to end, time per output token), its
tokens, its finish reason as vLLM's finished_reason, the requests running, a refusal (429) by its limit, a client
that leaves counted once as abort, the target's KV reservations over its budget, all under the served model name."""

from __future__ import annotations

import asyncio

import pytest

from actors.config import DraftWorkerConfig, RouterConfig, TargetConfig
from actors.draft_worker import DraftWorker
from actors.pools import LocalPool
from actors.router import Router
from actors.target_replica import LocalShards, TargetReplica
from actors.target_shard import TargetShard
from tests.actors.conftest import TinyPair
from tests.actors.test_router_local import fp32
from tests.ray_metrics import FakeRayMetrics, Recorder, fake_ray_metrics

MODEL = "tiny"


@pytest.fixture
def ray_metrics(monkeypatch: pytest.MonkeyPatch) -> FakeRayMetrics:
    return fake_ray_metrics(monkeypatch)


def make_router(pair: TinyPair, **router: object) -> Router:
    """The router over one draft worker and one target replica, every one of them naming the model MODEL."""
    target_cfg = TargetConfig(model=fp32(pair.target), model_name=MODEL)
    target = TargetReplica(target_cfg, shards=LocalShards([TargetShard(target_cfg, 0)]))
    draft = DraftWorker(DraftWorkerConfig(model=fp32(pair.draft), target_model=pair.target, model_name=MODEL))
    return Router(RouterConfig(model_name=MODEL, **router), LocalPool([draft]), LocalPool([target]))  # type: ignore[arg-type]


def recorded(made: dict[str, Recorder], name: str, **tags: str) -> float:
    """What `name` recorded under `tags` and the served model's name (a gauge's last value, else a sum)."""
    return made[name].values[tuple(sorted({"model_name": MODEL, **tags}.items()))]


def test_a_request_runs_through_vllms_moments(tiny_pair: TinyPair, ray_metrics: FakeRayMetrics) -> None:
    router, made = make_router(tiny_pair), ray_metrics.made
    sampling = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    usage = asyncio.run(router.generate([5, 6, 7], sampling))["usage"]
    assert recorded(made, "vllm_request_success", finished_reason="length") == 1
    assert recorded(made, "vllm_prompt_tokens") == recorded(made, "vllm_request_prompt_tokens") == 3
    assert recorded(made, "vllm_generation_tokens") == recorded(made, "vllm_request_generation_tokens") == 6
    queue, prefill, decode = (recorded(made, f"vllm_request_{p}_time_seconds") for p in ("queue", "prefill", "decode"))
    assert queue > 0 and prefill > 0 and decode > 0
    # the phases tile the request: arrival, scheduled, first token, last token (its end)
    assert queue + prefill + decode == pytest.approx(recorded(made, "vllm_e2e_request_latency_seconds"))
    assert recorded(made, "vllm_time_to_first_token_seconds") == pytest.approx(queue + prefill)
    assert recorded(made, "vllm_request_time_per_output_token_seconds") == pytest.approx(decode / 5)
    # one gap per step after the first: together the decode time
    assert recorded(made, "vllm_inter_token_latency_seconds") == pytest.approx(decode)
    assert recorded(made, "vllm_spec_decode_num_drafts") == recorded(made, "spec_decode_num_drafts") == usage["drafts"]
    assert recorded(made, "vllm_num_requests_running") == recorded(made, "vllm_num_requests_waiting") == 0
    assert recorded(made, "specserve_requests_total", finish_reason="length") == 1


def test_a_refusal_and_a_client_that_leaves(tiny_pair: TinyPair, ray_metrics: FakeRayMetrics) -> None:
    router, made = make_router(tiny_pair, max_active_sequences=1), ray_metrics.made

    async def scenario() -> float:
        held = router.generate_stream([5, 6], {"max_tokens": 50, "ignore_eos": True})
        await held.__anext__()  # its first tokens: it runs
        assert recorded(made, "vllm_num_requests_running") == 1
        with pytest.raises(Exception, match="max_active_sequences"):
            await router.generate([5, 6], {})
        reserved = recorded(made, "vllm_kv_cache_usage_perc")
        await held.aclose()
        return reserved

    reserved = asyncio.run(scenario())
    budget = asyncio.run(router.info())["kv_budget_tokens"]
    assert reserved == pytest.approx((2 + 50) / budget)  # the held request's prompt + max_tokens
    assert recorded(made, "specserve_requests_rejected_total", reason="max_active_sequences") == 1
    assert made["vllm_request_success"].by("finished_reason") == {"abort": 1}
    assert made["specserve_requests_total"].by("finish_reason") == {"cancelled": 1}
    assert recorded(made, "vllm_num_requests_running") == recorded(made, "vllm_num_requests_waiting") == 0
    assert recorded(made, "vllm_request_prefill_time_seconds") > 0
    assert recorded(made, "specserve_replica_up") == 1  # (one per replica object: all three here)
