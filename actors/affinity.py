"""Lane affinity as a Serve request router: every call of a lane goes to the same replica.

Why a custom `RequestRouter` (`RequestRouterConfig(request_router_class=...)`) rather than hand-kept
replica maps or `DeploymentHandle.options(multiplexed_model_id=...)`: the request router is where
Serve already learns of replicas coming and going (`update_replicas`), probes their queues and
retries around dead ones, so pinning there keeps affinity correct across scaling and failures
for free; multiplexing would need each replica to "load" a lane as a model and gives no balance.

The key is the `lane` keyword of each call. A new lane goes to the replica with the fewest lanes
pinned by this handle (ties: shorter queue, then random); a lane whose replica left is re-pinned
on its next call (the new replica re-prefills from the tokens the call carries). When replicas
are added, lanes move from the most to the least loaded replica until counts differ by at most
one, so a scale-up takes work at once. Calls without a lane (`info`, `describe`) go to the
replica with the shortest queue among all. The state is per handle, that is per router replica.
The base class (no `FIFOMixin`) assigns the chosen replica to exactly the request it was chosen
for, which affinity needs.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

R = TypeVar("R", bound=Hashable)  # a replica id


def lane_counts(pins: dict[str, R], replicas: list[R]) -> Counter[R]:
    counts: Counter[R] = Counter({r: 0 for r in replicas})
    counts.update(r for r in pins.values() if r in counts)
    return counts


def least_loaded(pins: dict[str, R], replicas: list[R], queue_len: Callable[[R], int]) -> R:
    """The replica with the fewest pinned lanes; ties: shorter queue, then random."""
    counts = lane_counts(pins, replicas)
    return min(replicas, key=lambda r: (counts[r], queue_len(r), random.random()))


def rebalance(pins: dict[str, R], replicas: list[R]) -> dict[str, R]:
    """Forget pins to replicas that left; move lanes until lane counts differ by at most one."""
    live = set(replicas)
    pins = {lane: r for lane, r in pins.items() if r in live}
    if not replicas:
        return pins
    counts = lane_counts(pins, replicas)
    while True:
        (most, high), (least, low) = counts.most_common()[0], counts.most_common()[-1]
        if high - low <= 1:
            return pins
        lane = next(lane for lane, r in pins.items() if r == most)
        pins[lane] = least
        counts[most] -= 1
        counts[least] += 1


class LaneAffinityRouter(RequestRouter):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pins: dict[str, ReplicaID] = {}

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._pins = rebalance(self._pins, [r.replica_id for r in replicas])

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        lane = None if pending_request is None else pending_request.kwargs.get("lane")
        if lane is None:
            return [candidate_replicas]  # one rank: the base class takes the shortest queue
        pinned = self._pins.get(lane)
        if pinned not in by_id:
            queue = self.replica_queue_len_cache
            pinned = least_loaded(self._pins, list(by_id), lambda r: queue.get(r) or 0)
            self._pins[lane] = pinned
        return [[by_id[pinned]]]

    def pins(self) -> dict[str, str]:
        """Lane -> replica id, for tests and operators."""
        return {lane: r.unique_id for lane, r in self._pins.items()}
