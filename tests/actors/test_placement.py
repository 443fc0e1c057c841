"""Placement on Ray with declared (fake) GPUs: no CUDA behind them, `device: cpu` by configuration.

One draft replica with one GPU, two target replicas of TP=2 with one GPU per shard: every draft
replica and every shard holds its own GPU id, the target replica actors hold none, and each
replica's shards sit in that replica's own placement group (STRICT_PACK: one node).
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
def ray_with_gpus(shm_op_built: None) -> Iterator[None]:
    with local_ray(num_cpus=8, num_gpus=6):
        yield


def test_each_worker_holds_its_own_gpu(ray_with_gpus: None, tiny_pair: TinyPair) -> None:
    config = AppConfig.model_validate(
        {
            "target_model": tiny_pair.target,
            "draft_model": tiny_pair.draft,
            "dtype": "float32",
            "device": "cpu",
            "tp_size": 2,
            "torch_threads": 1,
            "draft_pool": {"num_cpus": 0.5, "num_gpus": 1},
            "target_pool": {
                "shard_num_cpus": 0.5,
                "shard_num_gpus": 1,
                "autoscaling": {"min_replicas": 2, "max_replicas": 2},
            },
        }
    )
    with deployed(config) as handle:
        draft_handle = serve.get_deployment_handle("draft", app_name=APP)
        target_handle = serve.get_deployment_handle("target", app_name=APP)
        draft = draft_handle.describe.remote(lane="placement").result()
        # Two lanes pin to the two target replicas (fewest lanes first).
        targets = [target_handle.describe.remote(lane=f"placement-{i}").result() for i in range(2)]
        requests = [(p, {"temperature": 0.0, "max_tokens": m}) for p, m in prompts_and_lengths(2)]
        results = asyncio.run(gather_generate(handle, requests))

    print("draft", draft["replica"], "gpus", draft["gpu_ids"])
    for t in targets:
        shards = [(s["rank"], s["gpu_ids"], s["placement_group_id"][:8]) for s in t["shards"]]
        print("target", t["replica"], "gpus", t["gpu_ids"], "pg", t["placement_group_id"][:8], "shards", shards)
    assert len(draft["gpu_ids"]) == 1
    # Start-up objects are out of every collection's walk (actors/heap.py), in each kind of replica process.
    assert draft["heap_frozen"] > 100_000
    assert all(t["heap_frozen"] > 100_000 and all(s["heap_frozen"] > 100_000 for s in t["shards"]) for t in targets)
    assert targets[0]["replica"] != targets[1]["replica"]
    gpu_ids = list(draft["gpu_ids"])
    for target in targets:
        assert target["gpu_ids"] == [], "the replica actor relays; its shards hold the GPUs"
        assert target["placement_group_id"] is not None
        assert len(target["shards"]) == 2
        for shard in target["shards"]:
            assert len(shard["gpu_ids"]) == 1
            assert shard["placement_group_id"] == target["placement_group_id"]
            assert shard["node_id"] == target["node_id"]
            gpu_ids += shard["gpu_ids"]
        assert [s["rank"] for s in target["shards"]] == [0, 1]
    assert len(gpu_ids) == 5 and len(set(gpu_ids)) == 5, gpu_ids
    assert targets[0]["placement_group_id"] != targets[1]["placement_group_id"]
    for (prompt, params), result in zip(requests, results, strict=True):
        assert result["token_ids"] == hf_greedy(tiny_pair.target, prompt, int(params["max_tokens"]))
