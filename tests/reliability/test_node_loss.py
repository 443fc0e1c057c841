"""A node lost under load, on a multi-node Ray cluster simulated on this machine (`ray.cluster_utils.Cluster`).

The head holds the router; the draft pool is pinned to a node advertising `draft_node`, the two
target replicas to two nodes advertising `target_node` (the pools' `resources` config). Mid-load
one target node is removed: its processes die with it. Every request completes with the target's
own greedy tokens, since the remaining target replica can serve them all: lanes pinned to the
lost replica are re-pinned and re-prefilled there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from deploy.app import build_app
from deploy.config import AppConfig
from tests.actors.conftest import TinyPair, hf_greedy, prompts_and_lengths
from tests.actors.serve_helpers import REPO, run_app
from tests.reliability.conftest import describe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


Nodes = tuple[Cluster, list[Any]]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Nodes]:
    """Head (router, Serve's controller), one draft node, two target nodes."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    nodes = [
        cluster.add_node(num_cpus=1, resources={"draft_node": 1}),
        cluster.add_node(num_cpus=1, resources={"target_node": 1}),
        cluster.add_node(num_cpus=1, resources={"target_node": 1}),
    ]
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": REPO, "TOKENIZERS_PARALLELISM": "false"}})
    try:
        yield cluster, nodes
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def test_losing_a_target_node_mid_load_loses_no_request(
    cluster: tuple[Cluster, list[Any]], tiny_pair: TinyPair
) -> None:
    ray_cluster, (draft_node, *target_nodes) = cluster
    config = AppConfig.model_validate(
        {
            "target_model": tiny_pair.target,
            "draft_model": tiny_pair.draft,
            "dtype": "float32",
            "torch_threads": 1,
            # Each pool fills its node's one CPU, so the router (and nothing else) lands on the head.
            "draft_pool": {"num_cpus": 1.0, "resources": {"draft_node": 1}},
            "target_pool": {
                "shard_num_cpus": 0.9,
                "resources": {"target_node": 1},
                "autoscaling": {"min_replicas": 2, "max_replicas": 2},
            },
            "router_pool": {"num_cpus": 0.25, "router": {"max_lane_sequences": 2}},
        }
    )
    handle = run_app(build_app(config), attempts=2)
    placed = describe("draft")["node_id"]
    assert placed == draft_node.node_id, "the draft pool runs on the node that advertises draft_node"

    requests = [(p, max(m, 40)) for p, m in prompts_and_lengths(8, seed=3)]  # mid-decode when the node goes

    async def load_then_lose_a_node() -> list[list[int]]:
        started = asyncio.Event()  # every stream has its first tokens: every lane ran on its replica
        first: set[int] = set()

        async def one(index: int, prompt: list[int], max_new: int) -> list[int]:
            tokens: list[int] = []
            gen = handle.options(stream=True).generate_stream.remote(
                prompt, {"temperature": 0.0, "max_tokens": max_new}
            )
            async for chunk in gen:  # type: ignore[union-attr]
                tokens += chunk["token_ids"]
                first.add(index)
                if len(first) == len(requests):
                    started.set()
            return tokens

        streams = [asyncio.ensure_future(one(i, p, m)) for i, (p, m) in enumerate(requests)]
        await asyncio.wait_for(started.wait(), 120)
        # Every process of that node dies: one target replica and its shard.
        await asyncio.to_thread(ray_cluster.remove_node, target_nodes[0])
        return list(await asyncio.gather(*streams))

    results = asyncio.run(load_then_lose_a_node())
    stats = handle.stats.remote().result()
    print(f"verify calls by replica {stats['verify_calls']}")
    assert len(stats["verify_calls"]) == 2, "lanes were spread over both target replicas before the loss"
    for (prompt, max_new), tokens in zip(requests, results, strict=True):
        assert tokens == hf_greedy(tiny_pair.target, prompt, max_new)
