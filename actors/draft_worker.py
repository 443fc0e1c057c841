"""A draft replica: proposes token trees for a lane's micro-batch on one draft model.

Holds only soft state: a drafter (with its KV cache) per group key; every request carries the
sequence's committed tokens, so a replica that restarted or never saw a sequence re-prefills it. The
drafters' caches draw on one KV pool (speculative/engine/kv_pool.py); a call past it fails, and its
lane decodes without drafts for a while (a full draft replica costs speculation, not requests).
Calls are serialized (one model, one compute stream) and run in a thread so the replica keeps
answering Serve's health and metrics probes while it computes.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

from actors.config import DraftWorkerConfig
from actors.groups import GroupCaches
from actors.heap import freeze_heap
from actors.loading import Resolver, identity, load_grammars, load_lm, vocab_size_of
from actors.metrics import ReplicaMetrics
from actors.placement import replica_tag, where
from actors.scaling import BUSY_METRIC, BusyMeter
from actors.wire import Drafted, DraftInfo, Stopwatch, WireProposal
from speculative.drafters.base import Drafter, DraftRequest, empty_proposal
from speculative.engine.kv_budget import kv_budget_tokens, kv_bytes_per_token, max_model_len
from speculative.engine.kv_cache import preallocated
from speculative.engine.kv_pool import KvPool


class DraftWorker:
    def __init__(self, config: DraftWorkerConfig, resolve: Resolver = identity, own_process: bool = False) -> None:
        """`own_process`: the worker is alone in its process (a Serve replica), so `config.nice` applies."""
        self.config = config
        if own_process and config.nice:
            os.nice(config.nice)
        self.model = load_lm(config.model, resolve) if config.model is not None else None
        self.target_vocab = vocab_size_of(config.target_model, resolve)
        self.grammars = load_grammars(config.model.path, resolve) if config.model is not None else None
        self.limits = DraftInfo(None, None)  # a drafter without a model holds no KV
        self.pool: KvPool | None = None  # every group's drafter draws its KV buffers from it
        if self.model is not None:
            m = self.model
            budget = kv_budget_tokens(config.kv_budget_tokens, config.kv_memory_fraction, m.config, m.dtype, m.device)
            self.limits = DraftInfo(max_model_len(m.config), budget)
            self.pool = KvPool(budget, kv_bytes_per_token(m.config, m.dtype), "draft_pool.kv_budget_tokens")
        self._caches: GroupCaches[Drafter | None] = GroupCaches(self._new_drafter, config.idle_evict_s)
        self._lock = threading.Lock()  # one forward at a time on the shared model
        self._busy = BusyMeter()
        self._calls = 0
        self.tag = replica_tag(self)
        self._metrics = ReplicaMetrics(config.model_name)
        freeze_heap()

    def _new_drafter(self) -> Drafter | None:
        window, budget = self.limits.max_model_len, self.limits.kv_budget_tokens
        reserve = preallocated(budget, window) if window is not None and budget is not None else None
        graphs = self.config.model.graphs if self.config.model is not None else "off"
        return self.config.drafter.build(self.model, self.target_vocab, self.grammars, reserve, graphs, self.pool)

    async def propose(
        self, cache_key: str, requests: list[DraftRequest], release: list[str], lane: str | None = None
    ) -> Drafted:
        """Proposals for `requests` in order; first forgets `release`. `lane` is for request routing."""
        return await asyncio.to_thread(self._propose, cache_key, requests, release)

    def _propose(self, cache_key: str, requests: list[DraftRequest], release: list[str]) -> Drafted:
        with self._lock:
            self._busy.start()
            try:
                with Stopwatch() as sw:
                    self._caches.drop(self._caches.idle())
                    drafter = self._caches.get(cache_key)
                    if drafter is not None and release:
                        drafter.release(release)
                    try:
                        proposals = (
                            drafter.propose(requests) if drafter is not None else [empty_proposal(r) for r in requests]
                        )
                    except Exception:
                        self._caches.drop([cache_key])  # mid-speculation state: the next call re-prefills
                        raise
                self._calls += 1
            finally:
                self._busy.stop()
        return Drafted([WireProposal.encode(p) for p in proposals], sw.work, self.tag)

    async def release(self, cache_key: str, seq_ids: list[str], lane: str | None = None) -> None:
        await asyncio.to_thread(self._release, cache_key, seq_ids)

    def _release(self, cache_key: str, seq_ids: list[str]) -> None:
        with self._lock:
            drafter = self._caches.peek(cache_key)
            if drafter is not None:
                drafter.release(seq_ids)

    async def info(self, lane: str | None = None) -> DraftInfo:
        """The draft model's window and this replica's KV budget (measured once, at start)."""
        return self.limits

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom-metrics hook (see actors/scaling.py)."""
        return {BUSY_METRIC: self._metrics.busy(self._busy.take())}

    async def describe(self, lane: str | None = None) -> dict[str, Any]:
        """What this replica holds: lane groups and cached sequences (a cancelled or finished one is freed)."""
        return await asyncio.to_thread(self._describe)

    def _describe(self) -> dict[str, Any]:
        with self._lock:  # not while a proposal is changing the caches
            sequences = sum(d.cached_sequences() for d in self._caches.owners() if d is not None)
            groups = len(self._caches)
        return {
            "role": "draft",
            "replica": self.tag,
            "groups": groups,
            "sequences": sequences,
            "kv_budget_tokens": self.limits.kv_budget_tokens,
            "kv_budget_bytes": None if self.pool is None else self.pool.capacity,
            "kv_held_bytes": 0 if self.pool is None else self.pool.held(),
            "calls": self._calls,
            **where(),
        }
