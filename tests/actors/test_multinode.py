"""The cluster YAML on a multi-node Ray cluster (one machine): each pool lands on its own node type.

`ray.cluster_utils.Cluster` starts a head and two worker nodes, one declaring `draft_node` and one
`target_node` (as `ray start --resources` does on a real cluster). `deploy/cluster.yaml`, with tiny
models and fractional CPUs, is deployed through `app_builder` as `serve deploy` does: the draft
replica runs on the draft node, the target replica and both of its tensor-parallel shards on the
target node, and greedy output equals the target model alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from deploy.app import app_builder
from tests.actors.conftest import hf_greedy
from tests.actors.serve_helpers import APP, WORKER_ENV, deploy_yaml, gather_generate, run_app, small_cpu_args
from tests.e2e.test_front_doors import free_port
from tests.front_router import MODEL_NAME, save_tiny_pair

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PROMPTS = [([7, 8, 9, 10, 11, 7, 8], 12), ([12, 13, 14, 15, 12, 13], 16), ([20, 21, 22, 23, 24, 25, 26, 27], 20)]


@pytest.fixture(scope="module")
def cluster(shm_op_built: None) -> Iterator[dict[str, str]]:
    """Head (router, controller), a draft node and a target node; node ids by role."""
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        draft = nodes.add_node(num_cpus=1, resources={"draft_node": 1})
        target = nodes.add_node(num_cpus=2, resources={"target_node": 1})
        nodes.wait_for_nodes()
        # cluster.yaml's front door reads its key from SPECSERVE_API_KEY (the handle calls here need none)
        ray.init(address=nodes.address, runtime_env={"env_vars": {**WORKER_ENV, "SPECSERVE_API_KEY": "sk-test"}})
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": free_port()})
        yield {"head": nodes.head_node.node_id, "draft": draft.node_id, "target": target.node_id}
    finally:
        serve.shutdown()
        ray.shutdown()
        nodes.shutdown()


def test_cluster_yaml_places_each_pool_on_its_node_type(cluster: dict[str, str], tmp_path: Path) -> None:
    target, draft, _ = save_tiny_pair(tmp_path)
    config = deploy_yaml("cluster.yaml", small_cpu_args(target, draft, MODEL_NAME))
    (app,) = config["applications"]
    handle = run_app(app_builder(app["args"]), attempts=2)
    try:
        drafted = serve.get_deployment_handle("draft", app_name=APP).describe.remote(lane="where").result()
        verifier = serve.get_deployment_handle("target", app_name=APP).describe.remote(lane="where").result()
        requests: list[tuple[list[int], dict[str, Any]]] = [
            (p, {"temperature": 0.0, "max_tokens": m}) for p, m in PROMPTS
        ]
        results = asyncio.run(gather_generate(handle, requests))
    finally:
        serve.delete(APP)

    roles = {node: role for role, node in cluster.items()}
    print("draft on", roles[drafted["node_id"]], "| target on", roles[verifier["node_id"]], end=" ")
    print("| shards on", [roles[s["node_id"]] for s in verifier["shards"]])
    assert drafted["node_id"] == cluster["draft"]
    assert verifier["node_id"] == cluster["target"]
    assert [s["node_id"] for s in verifier["shards"]] == [cluster["target"]] * 2  # tp_size 2 from the YAML
    for (prompt, params), result in zip(requests, results, strict=True):
        assert result["token_ids"] == hf_greedy(str(target), prompt, int(params["max_tokens"]))
