"""Fixtures and fault injectors of the reliability tests: the tiny models of the actor tests, Serve's own actors."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import psutil
import ray
from ray import serve
from ray._private.state import actors as gcs_actors  # the GCS's table: needs no dashboard

from tests.actors.conftest import shm_op_built, tiny_pair  # noqa: F401  (fixtures shared with tests/actors)
from tests.actors.serve_helpers import APP
from tests.front_router import MODEL_NAME


def describe(deployment: str) -> dict[str, Any]:
    """`describe()` of the deployment's replica (the tests run one replica per pool)."""
    return dict(serve.get_deployment_handle(deployment, app_name=APP).describe.remote().result(timeout_s=60))


def kill_replica(deployment: str) -> str:
    """`ray.kill` the deployment's (only) Serve replica actor, as a crashed process would; its replica tag."""
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{APP}#{deployment}#")
    ]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    return names[0].rsplit("#", 1)[1]


def target_shard_killer() -> tuple[str, Callable[[], None]]:
    """The target replica's tag, and a fault that SIGKILLs its rank-0 shard's process (the replica stays up).

    Looked up beforehand: the fault runs inside a client's event loop, where a blocking handle call may not.
    """
    info = describe("target")
    pid = int(info["shards"][0]["pid"])
    return str(info["replica"]), lambda: os.kill(pid, signal.SIGKILL)


def actor_rss() -> dict[str, int]:
    """Resident memory (bytes) of each live actor process of the app: routers, draft and target replicas, shards."""
    out = {}
    for actor in gcs_actors().values():
        name, pid = str(actor["ActorClassName"]), int(actor["Pid"])
        if actor["State"] == "ALIVE" and (name == "TargetShard" or name.startswith(f"ServeReplica:{APP}:")):
            out[f"{name.rsplit(':', 1)[-1]}/{pid}"] = psutil.Process(pid).memory_info().rss
    return out


def greedy_completion(prompt: list[int], max_tokens: int, stream: bool = False) -> dict[str, Any]:
    """A /v1/completions body: greedy, exactly `max_tokens` new tokens, their ids sent back."""
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
