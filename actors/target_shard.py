"""One tensor-parallel shard of a target replica (the whole model at tp_size 1).

Every shard of a replica receives every call, in the same order, with the same arguments, and
runs the same `TargetVerifier` code: the same forwards (so the all-reduces inside line up), the
same logits on every rank (an all-reduce leaves one sum on all ranks), hence the same verdicts
and the same commits. The replica returns rank 0's verdicts and checks the others agree. Which
group caches to drop is decided by the replica and sent along, never by a shard's own clock, so
the shards' caches never diverge.

`ping` runs in its own concurrency group (`HEALTH_GROUP`, one thread of its own), so the replica's
health check is answered while a long verify runs: a shard that does not answer is lost, not busy.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Callable
from typing import Any

import ray

from actors import tp
from actors.config import TargetConfig, deterministic_on
from actors.cpu_cores import pin_process, rank_cores
from actors.groups import GroupCaches
from actors.heap import freeze_heap
from actors.loading import Resolver, identity, load_grammars, load_lm
from actors.placement import where
from actors.wire import Stopwatch, TargetInfo, WireVerifyItem, Work
from speculative.drafters.heads import TreeHeads
from speculative.engine.captured import TREE_ROOM, graphs_on, runner_for
from speculative.engine.cores import borrowing
from speculative.engine.invariant import make_deterministic
from speculative.engine.kv_budget import kv_budget_tokens, kv_bytes_per_token, max_model_len
from speculative.engine.kv_cache import preallocated
from speculative.engine.kv_pool import KvPool
from speculative.engine.loading import eos_ids_of
from speculative.engine.runner import ModelRunner
from speculative.planning.chunking import Sizing
from speculative.rules.acceptance import Verdict
from speculative.target import TargetVerifier

logger = logging.getLogger(__name__)

HEALTH_GROUP = "health"  # the actor's concurrency group for `ping` (RayShards declares it)


class TargetShard:
    def __init__(
        self, config: TargetConfig, rank: int, resolve: Resolver = identity, own_process: bool = False
    ) -> None:
        """`own_process`: the shard is alone in its process (a Ray actor), so `config.cpu_cores` applies."""
        self.config, self.rank, self._resolve = config, rank, resolve
        # a borrowing forward's kernel threads: thread 0 (this one) on its own cores, one per borrowed core
        self._borrow: tuple[int, ...] = ()
        if (
            own_process
            and config.cpu_cores is not None
            and pin_process(own := rank_cores(config.cpu_cores, rank, config.tp_size))
        ):
            self._borrow = (*own, *config.borrow_cores) if config.borrow_cores else ()
        self._verifiers: GroupCaches[TargetVerifier] | None = None
        self._info: TargetInfo | None = None
        self._pool: KvPool | None = None

    def address(self) -> tuple[str, int]:
        """Where rank 0 listens for the group rendezvous: this node's address and a free port."""
        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        with socket.socket() as s:
            s.bind(("", 0))
            return host, int(s.getsockname()[1])

    def load(self, address: str | None = None, port: int | None = None) -> TargetInfo:
        """Join the TP group (tp_size > 1: every rank must call this concurrently) and load the model."""
        world = self.config.tp_size
        if world > 1:
            if address is None or port is None:
                raise ValueError("tp_size > 1 needs rank 0's address and port")
            tp.join_group(self.rank, world, address, port, self.config.model.device, self.config.torch_extensions_dir)
        settings = self.config.model
        if world > 1 and settings.weights == "auto":  # shards split dense weights (`stored` is refused at tp_size > 1)
            settings = settings.model_copy(update={"weights": "dequantized"})
        model = load_lm(settings, self._resolve)
        eos = eos_ids_of(model)
        config = model.config
        model = tp.shard(model, world)
        if deterministic_on(self.config):
            why = make_deterministic(model)
            if why is not None and self.config.deterministic == "on":
                raise ValueError(f"deterministic: 'on', but {why}")
            if why is not None:
                logger.warning("target forwards are not batch invariant here: %s", why)
        budget = kv_budget_tokens(
            self.config.kv_budget_tokens, self.config.kv_memory_fraction, config, model.dtype, model.device, world
        )
        # Every group's runner draws its KV buffers from this one pool, sized to the budget.
        token_bytes = kv_bytes_per_token(config, model.dtype, world)
        pool = self._pool = KvPool(budget, token_bytes, "target_pool.kv_budget_tokens")
        # Eviction is the replica's decision (see the module docstring): the shard never expires keys.
        chunk = self.config.prefill_chunk_tokens
        window = max_model_len(config)
        reserve = preallocated(budget, window)
        graphs = self.config.model.graphs if world == 1 else "off"  # TP shards: DeepSpeed's forward, op by op
        if graphs_on(graphs, model):  # each group's cache is fixed at `reserve`: the window advertised is what it holds
            # (a fixed cache cannot grow into the pool: each group's is taken from it whole, at `reserve`)
            window = min(window, reserve[1] - TREE_ROOM)
        grammars = load_grammars(self.config.model.path, self._resolve)  # shared by the groups: soft state by seq id
        heads = self._heads(model)

        def verifier() -> TargetVerifier:
            runner = runner_for(model, graphs, reserve, lean=True, pool=pool)  # lean: the same bits, fewer calls
            return TargetVerifier(runner, chunk, eos, grammars, heads(runner) if heads is not None else None)

        if graphs_on(graphs, model):
            verifier()  # every bucket compiled now, at the replica's start (later groups' captures hit its caches)
        self._verifiers = GroupCaches(verifier, float("inf"))
        vocab = TargetVerifier(ModelRunner(model)).vocab_size
        self._info = TargetInfo(vocab, eos, self.config.model.path, window, budget, pool.capacity)
        freeze_heap()
        return self._info

    def _heads(self, model: Any) -> Callable[[ModelRunner], TreeHeads] | None:
        """The configured heads, checked against the model: per verifier, weights shared."""
        return self.config.heads.build_heads(model) if self.config.heads is not None else None

    def verify(
        self,
        cache_key: str,
        items: list[WireVerifyItem],
        release: list[str],
        drop: list[str],
        borrow: bool = False,
        sizing: Sizing | None = None,
    ) -> tuple[list[Verdict], Work]:
        """`borrow`: no draft call runs beside this one, so the GGUF kernel may use `borrow_cores` too. `sizing`:
        what sizes a long prompt's chunk (`TargetVerifier.verify`; every rank is given the same, so their forwards
        match)."""
        assert self._verifiers is not None, "load() first"
        with borrowing(self._borrow if borrow else ()) as placed, Stopwatch() as sw:
            self._verifiers.drop(drop)
            verifier = self._verifiers.get(cache_key)
            if release:
                verifier.release(release)
            verdicts = verifier.verify([item.decode() for item in items], sizing)
        crowded = bool(self._borrow) and not placed  # the planner prices such verifies apart (`StepCosts.beside`)
        return verdicts, dataclasses.replace(sw.work, tokens=verifier.last_tokens, crowded=crowded)

    def release(self, cache_key: str, seq_ids: list[str]) -> None:
        assert self._verifiers is not None, "load() first"
        verifier = self._verifiers.peek(cache_key)
        if verifier is not None:
            verifier.release(seq_ids)

    def drop(self, cache_keys: list[str]) -> None:
        assert self._verifiers is not None, "load() first"
        self._verifiers.drop(cache_keys)

    def info(self) -> TargetInfo:
        assert self._info is not None, "load() first"
        return self._info

    @ray.method(concurrency_group=HEALTH_GROUP)
    def ping(self) -> int:
        """This shard's rank: its process is up (answered beside a running verify, on the health thread)."""
        return self.rank

    def describe(self) -> dict[str, Any]:
        owners = [] if self._verifiers is None else self._verifiers.owners()
        sequences = sum(v.cached_sequences() for v in owners)
        held = 0 if self._pool is None else self._pool.held()
        return {
            "role": "target_shard",
            "rank": self.rank,
            "groups": len(owners),
            "sequences": sequences,
            "kv_held_bytes": held,  # what every group's KV buffers hold together (within the info's kv_budget_bytes)
            **where(),
        }
