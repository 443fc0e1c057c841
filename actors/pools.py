"""How the router reaches a pool of replicas: Serve handles in deployment, objects in tests.

Every call names its lane (`lane=`), the affinity key that `actors.affinity.LaneAffinityRouter`
pins to one replica; calls without a lane (`info`) go to any replica.
"""

from __future__ import annotations

from typing import Any, Protocol

from ray.exceptions import OutOfMemoryError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError


class ReplicaLost(RuntimeError):
    """An in-process pool's replica went away (tests); Serve pools raise Ray's own errors."""


def replica_lost(error: BaseException) -> bool:
    """True when a call failed because its replica went away or is full (retry: Serve routes to a live one),
    False when the replica refused the call itself (an error its input causes: retrying cannot help)."""
    return isinstance(error, RayActorError | BackPressureError | DeploymentUnavailableError | ReplicaLost)


def verify_failure(error: BaseException | None) -> str:
    """What the requests of a verify that failed for good are told (their stream's error event).

    A shard that Ray's memory monitor killed mid-forward raises OutOfMemoryError, which is not a lost
    replica: the same forward on the replacement would run out of memory again, so it is not retried.
    """
    if isinstance(error, OutOfMemoryError):
        return "out of memory: Ray's memory monitor killed the target shard running this batch (not retried)"
    return "target pool unavailable"


class Pool(Protocol):
    async def call(self, method: str, lane: str | None, *args: Any) -> Any: ...


class ServePool:
    """A deployment behind its `DeploymentHandle`; Serve picks the replica (by lane affinity)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def call(self, method: str, lane: str | None, *args: Any) -> Any:
        kwargs = {} if lane is None else {"lane": lane}
        return await getattr(self.handle, method).remote(*args, **kwargs)


class LocalPool:
    """Replica objects in this process, lanes pinned round-robin in order of first use (tests)."""

    def __init__(self, replicas: list[Any]) -> None:
        if not replicas:
            raise ValueError("a pool needs at least one replica")
        self.replicas = replicas
        self.pinned: dict[str, int] = {}

    async def call(self, method: str, lane: str | None, *args: Any) -> Any:
        index = 0 if lane is None else self.pinned.setdefault(lane, len(self.pinned) % len(self.replicas))
        return await getattr(self.replicas[index], method)(*args)
