"""A lane's calls to its draft replica: what each call tells the worker to forget, how long it may
take, and when the lane may call at all.

A draft failure never fails a request: after one, the lane decodes without speculation for
`draft_backoff_s`. A pre-draft that outlived its round (`actors/round_ahead.py`) is left to finish,
and the pool is not called again until it has answered, so a slow replica is never sent a second
call beside its first. The router's lanes count their calls in flight together (`InFlight`): a verify
sent while none runs may borrow the draft's cores (`TargetSettings.borrow_cores`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from actors.config import RouterConfig
from actors.pools import Pool
from actors.records import Live
from actors.wire import Drafted
from speculative.drafters.base import DraftRequest

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class InFlight:
    """Draft calls in flight from a router's lanes, counted from the moment each is made until it ends."""

    calls: int = 0

    def track(self, call: Awaitable[T]) -> asyncio.Future[T]:
        """`call` as a task, counted until it is done (answered, failed or cancelled, even before it started)."""
        task = asyncio.ensure_future(call)
        self.calls += 1
        task.add_done_callback(self._done)
        return task

    def _done(self, _: object) -> None:
        self.calls -= 1


class DraftCalls:
    """The draft pool as one lane calls it: per group, the sequence ids its next call releases."""

    def __init__(
        self, pool: Pool | None, lane: str, groups: int, config: RouterConfig, in_flight: InFlight | None = None
    ) -> None:
        self.pool, self.lane, self.config = pool, lane, config
        self.in_flight = in_flight or InFlight()  # the router's count, shared by its lanes
        self.release: list[list[str]] = [[] for _ in range(groups)]  # per group, sent with its next call
        self._off_until = 0.0  # no calls before this (`time.time()`): the backoff after a failure
        self._late: asyncio.Task[Drafted] | None = None  # a pre-draft that outlived its round

    def free(self) -> bool:
        """The draft pool may be called: no backoff after a failure, no pre-draft of ours still running."""
        if self._late is not None and self._late.done():
            self._late = None
        return self._late is None and time.time() >= self._off_until

    def deadline(self, work_tokens: int) -> float:
        """Seconds a draft call carrying this many tokens (to catch up on and to draft) may take before it
        counts as failed: sized to the work, so slow is not lost."""
        return self.config.draft_timeout_s + self.config.draft_timeout_per_token_s * work_tokens

    def failed(self, error: BaseException) -> None:
        logger.warning("lane %s: draft call failed (%r); no speculation for a while", self.lane, error)
        self._off_until = time.time() + self.config.draft_backoff_s

    async def propose(self, g: int, cache_key: str, requests: list[DraftRequest], work_tokens: int) -> Drafted:
        """Group `g`'s drafts, releasing what it holds to release; on failure the releases wait for the next call."""
        assert self.pool is not None
        call = self.pool.call("propose", self.lane, cache_key, requests, self.release[g])
        drafted: Drafted = await asyncio.wait_for(self.in_flight.track(call), self.deadline(work_tokens))
        self.release[g] = []
        return drafted

    def send(
        self, g: int, cache_key: str, requests: list[DraftRequest], work_tokens: int
    ) -> tuple[asyncio.Task[Drafted], list[str]]:
        """A call that runs beside the lane's next steps, and the releases it took along (for the group's
        list again if it fails)."""
        assert self.pool is not None
        released, self.release[g] = self.release[g], []
        call = self.in_flight.track(self.pool.call("propose", self.lane, cache_key, requests, released))
        return asyncio.get_running_loop().create_task(asyncio.wait_for(call, self.deadline(work_tokens))), released

    def leave_running(self, task: asyncio.Task[Drafted]) -> None:
        """Leave a call to finish unused; the pool is not called until it has answered."""
        self._late = task
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning


def draft_work(live: Live, request: DraftRequest) -> int:
    """Tokens a draft call computes for this request: those the pool has not seen (and a pre-draft's spine,
    forwarded again for its scores), then the drafts under every branch."""
    branches = 1 + request.alternatives
    return max(len(request.tokens) - live.draft_seen, 1) + request.spine + branches * request.budget


def send_work(sent: Iterable[tuple[Live, DraftRequest]]) -> int:
    """Tokens a draft call carrying these requests computes (`draft_work`, summed); from now on the pool
    has seen each request's tokens."""
    work = 0
    for live, request in sent:
        work += draft_work(live, request)
        live.draft_seen = len(request.tokens)
    return work
