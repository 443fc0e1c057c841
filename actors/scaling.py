"""Per-pool autoscaling on busy time, not queue length.

Why not Serve's default (ongoing requests per replica): the router sends a lane's whole
micro-batch in one call, so a replica holding 2 lanes of 16 sequences sees the same number of
ongoing requests as one holding 2 lanes of 1 sequence. Queue length measures lanes, not work. What
does measure work is the share of wall time a replica spends computing: a replica at 1.0 is the
bottleneck of every lane pinned to it (in a ping-pong step the slower pool is busy all the time,
the faster one only part of it), and the pool needs `sum(busy) / target_busy` replicas. Each
replica reports its busy fraction through Serve's `record_autoscaling_stats` hook; this policy
turns the sum into a replica count, and Serve applies min/max, upscale/downscale delays and
factors around it (`ray.serve.autoscaling_policy._apply_autoscaling_config`).

This module is cloudpickled by value into the Serve controller: it imports nothing heavy.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

BUSY_METRIC = "specserve_busy_fraction"


class BusyMeter:
    """Share of wall time spent inside `busy()` blocks since the last `take()`."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._since = clock()
        self._busy = 0.0
        self._started: float | None = None

    def start(self) -> None:
        with self._lock:
            self._started = self._clock()

    def stop(self) -> None:
        with self._lock:
            if self._started is not None:
                self._busy += self._clock() - self._started
                self._started = None

    def take(self) -> float:
        """The busy fraction of the window that ends now; starts a new window."""
        with self._lock:
            now = self._clock()
            busy = self._busy
            if self._started is not None:  # count the running part, carry the rest over
                busy += now - self._started
                self._started = now
            span, self._since, self._busy = now - self._since, now, 0.0
        return min(busy / span, 1.0) if span > 0 else 0.0


class BusyFractionPolicy:
    """Serve custom autoscaling policy: replicas = ceil(sum of busy fractions / target_busy).

    Configured per deployment as
    `autoscaling_config.policy = {"policy_function": "actors.scaling:BusyFractionPolicy",
    "policy_kwargs": {"target_busy": 0.6}}`.
    """

    def __init__(self, target_busy: float = 0.6) -> None:
        if not 0.0 < target_busy <= 1.0:
            raise ValueError(f"target_busy must be in (0, 1], got {target_busy}")
        self.target_busy = target_busy

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        busy = metrics.get(BUSY_METRIC, {})
        if not busy:  # no report yet (replicas starting): hold
            return ctx.target_num_replicas, ctx.policy_state
        total = sum(float(v) for v in busy.values())
        # Replicas that have not reported count as idle; the policy never goes below one replica
        # while there is any work, and Serve clamps to min/max.
        desired = (
            max(1, math.ceil(total / self.target_busy - 1e-9)) if total > 0 else ctx.capacity_adjusted_min_replicas
        )
        return desired, ctx.policy_state
