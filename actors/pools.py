"""How the router reaches a pool of replicas: Serve handles in deployment, objects in tests.

Every call names its lane (`lane=`), the affinity key that `actors.affinity.LaneAffinityRouter`
pins to one replica; calls without a lane (`info`) go to any replica.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any, Protocol

from ray.exceptions import OutOfMemoryError, RayActorError
from ray.serve import context as serve_context
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from speculative.engine.kv_pool import KvPoolFull


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
    A forward past its shard's KV pool (`KvPoolFull`) says so, with the pool's numbers.
    """
    if isinstance(error, OutOfMemoryError):
        return "out of memory: Ray's memory monitor killed the target shard running this batch (not retried)"
    if isinstance(error, KvPoolFull):
        while isinstance(cause := getattr(error, "cause", None), KvPoolFull) and cause is not error:
            error = cause  # the shard's own, under Ray's wrappers (whose text is a traceback)
        return f"out of KV memory: {error}"
    return "target pool unavailable"


class Pool(Protocol):
    async def call(self, method: str, lane: str | None, *args: Any) -> Any: ...


class ServePool:
    """A deployment behind its `DeploymentHandle`; Serve picks the replica (by lane affinity)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def call(self, method: str, lane: str | None, *args: Any) -> Any:
        kwargs = {} if lane is None else {"lane": lane}
        with own_request_id():
            response = getattr(self.handle, method).remote(*args, **kwargs)
        return await response


@contextlib.contextmanager
def own_request_id() -> Iterator[None]:
    """Handle calls made inside this block get an internal request id of their own.

    Serve gives every handle call made while serving a request that request's internal id, and its
    request router indexes the calls waiting for a replica by that id, one per id: of two such calls
    waiting at once (the `reserve` calls of a request's n sequences, when a slow replica's queue probe
    holds routing up), the second is never given a replica, and with it every call queued behind it
    at that deployment (other lanes' verifies) waits until the client goes away. The request id
    (logs, tracing) is kept; cancelling the awaiting task still cancels the call.
    """
    context = serve_context._serve_request_context
    current = context.get()
    if current is None or not current._internal_request_id:
        yield  # not inside a request: Serve makes a fresh id per call
        return
    token = context.set(dataclasses.replace(current, _internal_request_id=""))  # "": Serve makes a fresh one
    try:
        yield
    finally:
        context.reset(token)


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
