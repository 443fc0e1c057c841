"""A target replica: one tensor-parallel copy of the target, as `tp_size` shard actors.

The Serve replica owns a placement group of `tp_size` bundles (declared on the deployment with
`placement_group_bundles` + STRICT_PACK, so Serve creates, places and frees it with the replica)
and starts one `TargetShard` actor in each bundle. Why this and not Serve's gang scheduling
(`gang_scheduling_config`): a gang makes every rank its own Serve replica, which the request
router would route to independently, while a TP group must receive every call on all ranks in
lockstep. Here one Serve replica is one TP group: routing, affinity and autoscaling count whole
groups, and the replica is the only caller of its shards, so it alone orders their calls.

The replica itself reserves no GPU (its shards hold them) and serializes verify calls: the
shards must see calls in the same order, and a forward uses the whole model anyway.

Health is checked, not assumed: Serve's `check_health` (every `health_check_period_s`) and the
front doors' readiness (`ping`) ping every shard with a deadline, so a shard killed from outside
Ray (SIGKILL, the OOM killer) makes the replica unhealthy at the next check, with no request in
flight, and Serve replaces it; so does a verify forward that runs past its deadline, sized to its
tokens by what the replica measured (actors/verify_deadline.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Protocol, cast

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.admission import KvLedger
from actors.config import TargetConfig
from actors.heap import freeze_heap
from actors.loading import Resolver, identity
from actors.metrics import ReplicaMetrics
from actors.placement import replica_tag, where
from actors.scaling import BUSY_METRIC, BusyMeter
from actors.target_shard import HEALTH_GROUP, TargetShard
from actors.verify_deadline import VerifyDeadline, forward_tokens
from actors.wire import Reserved, TargetInfo, Verified, WireVerifyItem
from speculative.planning.chunking import ChunkBudget, Sizing

logger = logging.getLogger(__name__)

# A shard that does not answer a ping this long is lost. The ping runs on the shard's own health
# thread, beside any verify, so only a hung or unreachable process takes this long; Serve's own
# deadline for check_health (health_check_timeout_s) is 30 s by default.
SHARD_PING_TIMEOUT_S = 10.0

SHARD_NAME = "specserve-target-shard"  # shard actors are named SHARD_NAME:<replica actor id>:<rank>

# How a call sees a lost shard: its actor died (SIGKILL, a crash, its node), or Ray's memory monitor
# killed it (OutOfMemoryError, the death cause every later call to that actor gets too).
SHARD_LOST = (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError)


class Shards(Protocol):
    async def call(self, method: str, *args: Any) -> list[Any]:
        """Run `method(*args)` on every shard; results in rank order."""
        ...


class LocalShards:
    """In-process shards (tp_size 1 only: one process cannot hold two ranks); for tests without Ray."""

    def __init__(self, shards: list[TargetShard]) -> None:
        if len(shards) != 1:
            raise ValueError("in-process shards support tp_size 1 only")
        self.shards = shards
        shards[0].load()

    async def call(self, method: str, *args: Any) -> list[Any]:
        return [await asyncio.to_thread(getattr(self.shards[0], method), *args)]


class RayShards:
    """`TargetShard` actors in the calling replica's placement group, one per bundle."""

    def __init__(self, config: TargetConfig, resolve: Resolver) -> None:
        pg = ray.util.get_current_placement_group()
        if pg is None and config.tp_size > 1:
            logger.warning("no placement group: the %d shards may land on different nodes", config.tp_size)
        # `ping`'s own thread, answered beside a verify (declared here: `.options()` cannot set it; the
        # cast because ray.remote's typed overloads leave concurrency_groups out).
        remote: Any = cast(Any, ray.remote)(concurrency_groups={HEALTH_GROUP: 1})(TargetShard)
        owner = ray.get_runtime_context().get_actor_id() or "driver"
        self.actors: list[Any] = [
            remote.options(
                name=f"{SHARD_NAME}:{owner}:{rank}",  # findable (`ray list actors`, fault tests); gone with the replica
                num_cpus=config.shard_num_cpus,
                num_gpus=config.shard_num_gpus,
                scheduling_strategy=None if pg is None else PlacementGroupSchedulingStrategy(pg, rank),
            ).remote(config, rank, resolve, own_process=True)
            for rank in range(config.tp_size)
        ]
        address, port = ray.get(self.actors[0].address.remote()) if config.tp_size > 1 else (None, None)
        ray.get([a.load.remote(address, port) for a in self.actors], timeout=config.shard_start_timeout_s)

    async def call(self, method: str, *args: Any) -> list[Any]:
        # One copy of large arguments in the object store, read by every shard.
        refs = [ray.put(a) if isinstance(a, list) and len(self.actors) > 1 else a for a in args]
        return list(await asyncio.gather(*[getattr(a, method).remote(*refs) for a in self.actors]))


class TargetReplica:
    def __init__(self, config: TargetConfig, resolve: Resolver = identity, shards: Shards | None = None) -> None:
        self.config = config
        self.shards: Shards = shards if shards is not None else RayShards(config, resolve)
        self._lock = asyncio.Lock()
        self._waiting = 0  # verify calls waiting for the lock
        self._used: dict[str, float] = {}  # group key -> last use (monotonic)
        self._busy = BusyMeter()
        self._deadline = VerifyDeadline(config.verify_deadline_factor, config.verify_deadline_min_s)
        # every group's forwards measured together (one model, one cost); only where chunks are sized by them
        factor = config.prefill_round_factor
        self._chunks = ChunkBudget(factor) if factor is not None else None
        self._failed: BaseException | None = None
        self._calls = 0
        self._disagreements = 0
        self.tag = replica_tag(self)
        self._info: TargetInfo | None = None
        self._ledger: KvLedger | None = None  # KV reservations, from the first call (the shards' budget)
        self._metrics = ReplicaMetrics(config.model_name)
        freeze_heap()

    async def verify(
        self,
        cache_key: str,
        items: list[WireVerifyItem],
        release: list[str],
        borrow: bool = False,
        lane: str | None = None,
    ) -> Verified:
        """Verify a micro-batch on every shard; rank 0's verdicts. `borrow`: no draft call runs beside it (the
        shards' `borrow_cores` are free). `lane` is for request routing.

        Once a shard is lost, a call fails as a lost replica (RayActorError), which lanes retry onto the
        replica Serve starts instead; only the forward the loss interrupted carries its cause (an
        OutOfMemoryError is not retried: the same forward would run out of memory again).
        """
        ledger = await self._kv()
        ledger.release(release)
        ledger.running({item.seq_id: item.reserved for item in items})
        self._waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self._waiting -= 1
        try:
            if self._failed is not None:  # checked under the lock: a call queued behind the lost forward too
                raise ray.exceptions.ActorUnavailableError(f"lost a shard ({type(self._failed).__name__})", None)
            self._deadline.start(forward_tokens(items, self.config.prefill_chunk_tokens))
            seconds = None  # measured only where the forward answered
            # alone: every sequence this replica holds is in this call
            sizing = Sizing(self._chunks, len(ledger) <= len(items)) if self._chunks is not None else None
            try:
                expired = self._expired(cache_key)
                results = await self._on_shards("verify", cache_key, items, release, expired, borrow, sizing)
                work = results[0][1]
                seconds = work.seconds
                if self._chunks is not None:
                    self._chunks.observe(work.tokens, seconds)
            finally:
                self._deadline.stop(seconds)
        except Exception as e:
            if not isinstance(e, SHARD_LOST):
                # A forward that failed half-way leaves the group's caches mid-speculation: forget them on
                # every rank, so the next call re-prefills instead of failing on that state forever.
                await self._on_shards("drop", [cache_key])
            raise
        finally:
            self._lock.release()
        verdicts, work = results[0]
        if any(v != verdicts for v, _ in results[1:]):
            # Cannot happen with identical logits; if it does, the shards' caches now differ, and the
            # next forward would be shaped differently per rank. Forget the group everywhere: the
            # next call re-prefills it identically on all ranks (rank 0's verdicts stand).
            self._disagreements += 1
            logger.error("target shards disagree on %s; dropping the group's caches", cache_key)
            async with self._lock:
                await self._on_shards("drop", [cache_key])
        self._calls += 1
        return Verified(verdicts, work, self._waiting, self.tag)

    async def release(self, cache_key: str, seq_ids: list[str], lane: str | None = None) -> None:
        (await self._kv()).release(seq_ids)
        async with self._lock:
            await self._on_shards("release", cache_key, seq_ids)

    async def reserve(self, seq_id: str, tokens: int, lane: str | None = None) -> Reserved:
        """Reserve KV for a sequence about to be admitted (actors/admission.py); released with the sequence."""
        return (await self._kv()).reserve(seq_id, tokens)

    async def unreserve(self, seq_ids: list[str], lane: str | None = None) -> None:
        """Return reservations of sequences never admitted (their admission failed or was cancelled)."""
        (await self._kv()).release(seq_ids)

    async def info(self) -> TargetInfo:
        """Rank 0's model facts, with the smallest shard's KV budget (each shard measured its own memory)."""
        if self._info is None:
            infos: list[TargetInfo] = await self.shards.call("info")
            smallest = min(infos, key=lambda i: i.kv_budget_tokens)
            self._info = dataclasses.replace(
                infos[0], kv_budget_tokens=smallest.kv_budget_tokens, kv_budget_bytes=smallest.kv_budget_bytes
            )
        return self._info

    async def _kv(self) -> KvLedger:
        if self._ledger is None:
            budget = (await self.info()).kv_budget_tokens
            self._ledger = self._ledger or KvLedger(budget, self.config.idle_evict_s, self.tag, self._metrics.kv)
        return self._ledger

    async def describe(self, lane: str | None = None) -> dict[str, Any]:
        """The replica and its shards; `sequences`: sequences whose KV rank 0 holds (all ranks hold the same)."""
        async with self._lock:  # between verify calls: the caches are settled
            shards = await self.shards.call("describe")
        info = await self.info()
        return {
            "role": "target",
            "replica": self.tag,
            "tp_size": self.config.tp_size,
            "calls": self._calls,
            "disagreements": self._disagreements,
            "sequences": shards[0]["sequences"],
            "kv_budget_tokens": info.kv_budget_tokens,
            "kv_budget_bytes": info.kv_budget_bytes,  # per shard
            "kv_held_bytes": max(s["kv_held_bytes"] for s in shards),  # in the fullest shard's KV pool
            "kv_reserved_tokens": (await self._kv()).held,
            "kv_reserved_sequences": len(await self._kv()),
            "shards": shards,
            **where(),
        }

    async def ping(self, lane: str | None = None) -> str:
        """Every shard answers (else RuntimeError): the replica can serve. Its tag; what readiness probes ask."""
        await self.check_health()
        return self.tag

    async def check_health(self) -> None:
        """Serve's health hook: a lost shard makes the replica unhealthy, and Serve replaces it.

        A shard is lost once a call saw its actor die, or when it does not answer a ping in
        SHARD_PING_TIMEOUT_S (a process killed while no request ran is found here).
        """
        if self._failed is not None:
            raise RuntimeError(f"a target shard failed: {type(self._failed).__name__}")
        if (hung := self._deadline.overdue()) is not None:
            raise RuntimeError(f"hung: {hung}")
        try:
            await asyncio.wait_for(self.shards.call("ping"), SHARD_PING_TIMEOUT_S)
        except SHARD_LOST as e:
            self._failed = e
            raise RuntimeError(f"a target shard failed: {type(e).__name__}") from e
        except TimeoutError:
            raise RuntimeError(f"a target shard did not answer a ping within {SHARD_PING_TIMEOUT_S:.0f} s") from None

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {BUSY_METRIC: self._metrics.busy(self._busy.take())}

    def _expired(self, current: str) -> list[str]:
        now = time.monotonic()
        self._used[current] = now
        gone = [k for k, t in self._used.items() if now - t > self.config.idle_evict_s]
        for key in gone:
            del self._used[key]
        return gone

    async def _on_shards(self, method: str, *args: Any) -> list[Any]:
        self._busy.start()
        try:
            return await self.shards.call(method, *args)
        except SHARD_LOST as e:
            self._failed = e
            raise
        finally:
            self._busy.stop()
