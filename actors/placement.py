"""Where a worker runs, as Ray sees it: for placement checks and the operator's `describe()`."""

from __future__ import annotations

import os
from typing import Any

import ray

from actors.cpu_cores import usable_cores
from actors.heap import frozen_objects


def replica_tag(owner: object) -> str:
    """The Serve replica id of the calling replica, else a name unique to `owner` in this process."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # not inside a Serve replica (plain-Python tests)
        return f"local-{id(owner):x}"


def where() -> dict[str, Any]:
    """GPU ids, node, placement group and process of the calling actor (plain values outside Ray)."""
    info: dict[str, Any] = {
        "pid": os.getpid(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "gpu_ids": [],
        "node_id": None,
        "placement_group_id": None,
        "cpu_cores": sorted(usable_cores()),  # where the process may run (actors/cpu_cores.py)
        "niceness": os.nice(0),
        "heap_frozen": frozen_objects(),  # start-up objects no collection walks (actors/heap.py)
    }
    if not ray.is_initialized():
        return info
    ctx = ray.get_runtime_context()
    pg = ray.util.get_current_placement_group()
    info.update(
        gpu_ids=[str(g) for g in ray.get_gpu_ids()],
        node_id=ctx.get_node_id(),
        placement_group_id=None if pg is None else pg.id.hex(),
        actor_id=ctx.get_actor_id(),
    )
    return info
