"""CPU cores as a device: a target shard's threads on cores of their own, the rest of a local run off them.

On a CPU machine a pool's device is its cores, but Linux places threads wherever there is room: while the
draft's core is busy, the wake-ups of Ray's and Serve's background threads (gRPC pollers, the controller,
the raylet) and the draft's own thread land on the target's core and preempt its forward. Pinning the
target shard to its cores and everything else the local run starts to the other cores keeps the target's
cores its own, as a GPU would be (docs/design.md, "Catching up beside the prefill").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection

logger = logging.getLogger(__name__)


def usable_cores() -> set[int]:
    """The cores this process may run on (all of them where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def pin_process(cores: Collection[int]) -> bool:
    """Every thread of this process runs on `cores` from now on, and so do the threads and processes it
    starts later (they inherit it). False, with a warning, where the OS has no affinity (not Linux) or
    refuses the set (a core that does not exist or that a container's cpuset leaves out): the process
    runs on as before, since pinning changes speed, never results."""
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        logger.warning("cpu_cores %s: this OS sets no thread affinity; the process runs unpinned", sorted(cores))
        return False
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), set(cores))
        except ProcessLookupError:  # the thread ended since the listing
            continue
        except OSError as e:
            logger.warning("cpu_cores %s: %s; the process runs unpinned", sorted(cores), e)
            return False
    return True


def rank_cores(cores: tuple[int, ...], rank: int, world: int) -> tuple[int, ...]:
    """Tensor-parallel rank `rank`'s equal slice of the replica's `cores` (their count divides by `world`)."""
    n = len(cores) // world
    return cores[rank * n : (rank + 1) * n]
