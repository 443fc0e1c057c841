"""A local run with `target_pool.cpu_cores` (deploy/local.yaml pins the target to core 0): the target shard
runs on its core and nothing else the run starts does (Ray's and Serve's processes, the draft, the router),
the draft runs below the target's priority, the output is the target's own, and the driver gets its cores
back when the run stops. The CPU stand-in for
the target's own device (actors/cpu_cores.py)."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
from ray import serve

from actors.cpu_cores import usable_cores
from deploy.front.proxy_guard import PROXY_CALLBACK, PROXY_CALLBACK_ENV
from deploy.local.demo import deploy_local, start_local_ray, stop_local_ray
from tests.actors.conftest import hf_greedy
from tests.actors.serve_helpers import APP, REPO, free_port, merged, small_cpu_args
from tests.front_router import MODEL_NAME, save_tiny_pair

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(len(usable_cores()) < 2, reason="the target's core and at least one other"),
]


def test_the_target_shard_has_its_core_to_itself(tmp_path: Path) -> None:
    before = usable_cores()
    core = min(before)
    target_path, draft_path, _ = save_tiny_pair(tmp_path)
    args = merged(small_cpu_args(target_path, draft_path, MODEL_NAME), {"target_pool": {"cpu_cores": [core]}})
    prompt = [7, 8, 9, 10, 11, 7, 8, 9]
    earlier = {p.pid for p in psutil.Process().children(recursive=True)}  # not this run's (earlier tests')
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", REPO)  # the workers import this checkout, not an installed copy
        env.setenv(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
        start_local_ray(args, metrics_port=free_port())
        try:
            driver = usable_cores()
            deploy_local(args, free_port())
            target = serve.get_deployment_handle("target", app_name=APP).describe.remote(lane="cores").result()
            draft = serve.get_deployment_handle("draft", app_name=APP).describe.remote(lane="cores").result()
            sampling = {"temperature": 0.0, "max_tokens": 16}
            done = serve.get_app_handle(APP).generate.remote(prompt, sampling).result(timeout_s=120)
            shard_pids = {s["pid"] for s in target["shards"]}
            others = {
                p.pid: set(p.cpu_affinity())
                for p in psutil.Process().children(recursive=True)
                if p.pid not in shard_pids | earlier and p.is_running()
            }
        finally:
            stop_local_ray()
    assert driver == before - {core}
    assert [s["cpu_cores"] for s in target["shards"]] == [[core]]
    assert core not in draft["cpu_cores"] and core not in target["cpu_cores"]
    # Ray's workers at niceness 0, the draft at its pool's `nice` (10) below the target and the router.
    assert [s["niceness"] for s in target["shards"]] == [0] and target["niceness"] == 0
    assert draft["niceness"] == 10
    assert len(others) >= 3, "Ray's GCS and raylet, Serve's controller and the replicas"
    assert all(core not in cores for cores in others.values()), others
    assert done["token_ids"] == hf_greedy(str(target_path), prompt, 16)
    assert usable_cores() == before
