"""The deployed application on local Ray (CPU): greedy output equals the target alone.

TP=1 and TP=2 targets (DeepSpeed AutoTP over gloo), one and two draft replicas, 10 concurrent
requests of different prompt and output lengths; lanes of at most 3 sequences, so a router
spreads its lanes over both draft replicas.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from ray import serve

from deploy.config import AppConfig
from tests.actors.conftest import TinyPair, hf_greedy, prompts_and_lengths
from tests.actors.serve_helpers import APP, deployed, gather_generate, local_ray

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def ray_local(shm_op_built: None) -> Iterator[None]:
    with local_ray(num_cpus=8):
        yield


def app_config(pair: TinyPair, tp_size: int, drafts: int, **router: object) -> AppConfig:
    return AppConfig.model_validate(
        {
            "target_model": pair.target,
            "draft_model": pair.draft,
            "dtype": "float32",
            "tp_size": tp_size,
            "torch_threads": 1,
            "draft_pool": {"num_cpus": 0.5, "autoscaling": {"min_replicas": drafts, "max_replicas": drafts}},
            "target_pool": {"shard_num_cpus": 0.5},
            "router_pool": {"router": {"max_lane_sequences": 3, **router}},
        }
    )


@pytest.mark.parametrize(("tp_size", "drafts"), [(1, 1), (1, 2), (2, 1), (2, 2)], ids=lambda x: str(x))
def test_greedy_identical_to_target_alone(ray_local: None, tiny_pair: TinyPair, tp_size: int, drafts: int) -> None:
    """Depths follow each sequence's acceptance, not the measured load: weighed by load, these tiny
    models may rightly be decoded plainly after the first lane's first round (a CI run saw one draft
    call in all), and the draft replicas the lanes are spread over would then go unasked."""
    config = app_config(tiny_pair, tp_size, drafts)
    config = AppConfig.model_validate(config.model_dump() | {"speculation": {"load_adaptive": False}})
    requests = prompts_and_lengths(10)
    with deployed(config) as handle:
        results = asyncio.run(
            gather_generate(handle, [(p, {"temperature": 0.0, "max_tokens": m}) for p, m in requests])
        )
        stats = handle.stats.remote().result()
    for (prompt, max_new), result in zip(requests, results, strict=True):
        assert result["token_ids"] == hf_greedy(tiny_pair.target, prompt, max_new)
    assert sum(r["usage"]["accepted"] for r in results) > 0
    assert len(stats["draft_calls"]) == drafts, stats  # lanes spread over every draft replica
    assert len(stats["verify_calls"]) == 1, stats
    print(f"tp={tp_size} drafts={drafts}: {stats}")


def test_prompt_lookup_app_greedy_identical_to_target_alone(ray_local: None, tiny_pair: TinyPair) -> None:
    """No draft model: the router looks up n-grams itself and no draft pool is deployed. Depths are
    fixed by each sequence's acceptance (not by the measured load, which on a slow machine may rightly
    choose plain decoding for these tiny models), so the run is sure to speculate; the load-weighed
    lookup path is checked in-process in tests/unit/test_greedy_exact.py."""
    config = app_config(tiny_pair, 1, 1).model_copy(update={"draft_model": None})
    config = AppConfig.model_validate(
        config.model_dump() | {"drafter": {"kind": "lookup"}, "speculation": {"load_adaptive": False}}
    )
    assert config.router().lookup_ngrams == (3, 1)
    requests = prompts_and_lengths(10)
    with deployed(config) as handle:
        assert sorted(serve.status().applications[APP].deployments) == ["router", "target"]
        results = asyncio.run(
            gather_generate(handle, [(p, {"temperature": 0.0, "max_tokens": m}) for p, m in requests])
        )
    for (prompt, max_new), result in zip(requests, results, strict=True):
        assert result["token_ids"] == hf_greedy(tiny_pair.target, prompt, max_new)
    assert sum(r["usage"]["accepted"] for r in results) > 0


def test_stream_through_the_handle(ray_local: None, tiny_pair: TinyPair) -> None:
    prompt, max_new = prompts_and_lengths(3)[2]

    async def stream() -> list[dict]:
        gen = handle.options(stream=True).generate_stream.remote(prompt, {"temperature": 0.0, "max_tokens": max_new})
        return [chunk async for chunk in gen]  # type: ignore[union-attr]

    with deployed(app_config(tiny_pair, 1, 1, pipelining=False)) as handle:
        chunks = asyncio.run(stream())
    assert [t for c in chunks for t in c["token_ids"]] == hf_greedy(tiny_pair.target, prompt, max_new)
    assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == max_new
