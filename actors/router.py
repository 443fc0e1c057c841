"""The router: the ingress and the single source of truth of every sequence.

It admits requests (validated token ids and sampling parameters), places each sequence in a lane
(`actors/lane.py`), and hands the client the lane's commits as they come. A lane is pinned to one
draft replica and one target replica by `actors.affinity.LaneAffinityRouter` (Serve's request
router, keyed by the lane name each call carries), so the sequence's caches stay warm; if either
replica goes away the next call lands on another, which re-prefills from the tokens the router
sends. Lanes open when the existing ones hold `max_lane_sequences` and close when they empty:
lanes are how one router spreads its load over many replicas of each pool.

Method shapes are those a FastAPI front door wraps: `generate` returns one dict, and
`generate_stream` is an async generator of chunks `{"token_ids": [...], "finish_reason": None |
"stop" | "length"}`, the last one with `usage`.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from actors.admission import ContextWindow
from actors.config import RouterConfig
from actors.draft_calls import InFlight
from actors.heap import freeze_heap
from actors.lane import Lane, LaneContext
from actors.loading import Resolver, identity, load_decoder
from actors.metrics import ReplicaMetrics, RouterMetrics
from actors.pools import Pool, ServePool
from actors.records import Live, StepRecord
from actors.wire import DraftInfo, Reserved, TargetInfo
from speculative.planning.costs import StepCosts
from speculative.planning.sequence import Sequence
from speculative.rules.sampling import SamplingParams

logger = logging.getLogger(__name__)


class Overloaded(RuntimeError):
    """The router holds `max_active_sequences` already, or the target replica's KV budget has no room for the
    request yet; retry later (HTTP 429 with Retry-After at the front door)."""


class StreamTimeout(RuntimeError):
    """The request ran past `max_stream_s`: ended with this error (the bound on a router replica's drain)."""


class GenerationFailed(RuntimeError):
    """The request ended with an error, its words the cause: its own row failed at the target (its grammar, its
    parameters) while its group-mates went on, or the target pool was lost for good (HTTP 500 saying so)."""


async def collected(stream: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    """A `generate_stream`'s chunks as one result: token_ids, finish_reason, usage (and logprobs when asked)."""
    tokens: list[int] = []
    logprobs: list[dict[str, Any]] = []
    last: dict[str, Any] = {}
    async for chunk in stream:
        tokens += chunk["token_ids"]
        logprobs += chunk.get("logprobs", [])
        last = chunk
    out = {"token_ids": tokens, "finish_reason": last.get("finish_reason"), "usage": last.get("usage", {})}
    return out | ({"logprobs": logprobs} if "logprobs" in last else {})


class Router:
    def __init__(
        self,
        config: RouterConfig,
        draft: Pool | Any | None,
        target: Pool | Any,
        tokenizer: str | None = None,
        resolve: Resolver = identity,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        """`draft` / `target`: `Pool`s, or Serve `DeploymentHandle`s (wrapped once, here).

        `decode` (token ids -> text, for stop strings) defaults to the tokenizer at `tokenizer`, if any.
        """
        self.config = config
        self.router_id = _replica_id() or uuid.uuid4().hex[:8]  # Serve's replica id, else a fresh one
        self._draft = None if draft is None else _as_pool(draft)
        self._target = _as_pool(target)
        self._decode = decode if decode is not None or tokenizer is None else load_decoder(tokenizer, resolve)
        self._info: TargetInfo | None = None
        self._window: ContextWindow | None = None  # what one sequence can be given (set with _info)
        self._info_lock = asyncio.Lock()
        self._background: set[asyncio.Task[Any]] = set()  # releases of reservations a failed admission made
        self._lanes: dict[int, Lane] = {}
        self._joining: Counter[int] = Counter()  # lane index -> sequences waiting for their KV reservation
        self._live: dict[str, Live] = {}
        self._ids = itertools.count()
        self._records: deque[StepRecord] = deque(maxlen=config.stats_window)
        self._metrics = RouterMetrics(config.model_name)
        ReplicaMetrics(config.model_name)
        self._costs = StepCosts(config.depth)  # lanes come and go; what a verify or draft costs here outlives them
        self._drafting = InFlight()  # draft calls in flight from every lane (a verify beside none may borrow cores)
        freeze_heap()

    # ---- public API ----------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], sampling: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run one request to completion: token_ids, finish_reason, usage (and logprobs when asked)."""
        return await collected(self.generate_stream(prompt_token_ids, sampling))

    async def generate_stream(
        self, prompt_token_ids: list[int], sampling: dict[str, Any] | None = None
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Chunks of new tokens as they are committed; the last carries finish_reason and usage."""
        live = await self._admit(prompt_token_ids, sampling or {})
        limit = self.config.max_stream_s
        deadline = asyncio.get_running_loop().time() + limit
        try:
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        chunk = await live.chunks.get()
                except TimeoutError:
                    raise StreamTimeout(f"the request ran past max_stream_s ({limit:g} s)") from None
                if "error" in chunk:
                    raise GenerationFailed(chunk["error"])
                yield chunk
                if chunk["finish_reason"] is not None:
                    return
        finally:
            self._metrics.finished(live, "cancelled", time.time())  # (counted already where the lane ended it)
            live.cancelled = True  # a client that went away: the lane drops it between rounds
            self._live.pop(live.seq.seq_id, None)
            self._census()

    async def stats(self, reset: bool = False) -> dict[str, Any]:
        """Means over the recorded rounds: step time, draft and target compute, router overhead."""
        records = list(self._records)
        if reset:
            self._records.clear()
        return summarize(records) | {"active": len(self._live), "lanes": len(self._lanes)}

    async def info(self) -> dict[str, Any]:
        """The target's vocab_size, eos_ids and model; `context_window`: most prompt + max_tokens one request may
        have (the model's window, or less where a replica's KV budget is smaller), and `context_limit` names what
        sets it (with its config key); a target replica's KV budget in tokens and the most bytes its KV buffers
        hold (`kv_budget_bytes`, its KV pool)."""
        info = await self._target_info()
        assert self._window is not None, "set with the target's info"
        return {
            "vocab_size": info.vocab_size,
            "eos_ids": sorted(info.eos_ids),
            "model": info.model,
            "context_window": self._window.tokens,
            "context_limit": self._window.limit,
            "kv_budget_tokens": info.kv_budget_tokens,
            "kv_budget_bytes": info.kv_budget_bytes,
        }

    # ---- admission -----------------------------------------------------------------------
    async def _admit(self, prompt: list[int], sampling: dict[str, Any]) -> Live:
        arrived = time.time()
        params = SamplingParams.model_validate(sampling)
        if params.stop and self._decode is None:
            raise ValueError("stop: stop strings need a tokenizer, and this deployment has none")
        info = await self._target_info()
        if not prompt or not isinstance(prompt, list):
            raise ValueError("prompt_token_ids: must be a non-empty list of token ids")
        if any(not isinstance(t, int) or not 0 <= t < info.vocab_size for t in prompt):
            raise ValueError(f"prompt_token_ids: token ids must be integers in 0..{info.vocab_size - 1}")
        assert self._window is not None, "set with the target's info"
        check_window(len(prompt), params.max_tokens, self._window)
        active = len(self._live) + sum(self._joining.values())  # joining: admitted, reservation being asked for
        if active >= self.config.max_active_sequences:
            self._metrics.refused("max_active_sequences")
            raise Overloaded(f"{active} sequences active (max_active_sequences)")
        seq_id = f"{self.router_id}-{next(self._ids)}"
        index = self._lane_for_new()
        self._joining[index] += 1  # counted as the lane's while its reservation is asked for
        self._census()
        try:
            await self._reserve(index, seq_id, len(prompt) + params.max_tokens)
            live = Live(Sequence(seq_id, list(prompt), params), admitted=arrived)
            self._live[seq_id] = live
            self._lane(index).add(live)
        finally:
            self._joining[index] -= 1
            if not self._joining[index]:
                del self._joining[index]
            self._census()
        return live

    def _census(self) -> None:
        """The request counts on the metrics: active sequences, and those running (in a verify call once) and
        waiting (not yet, or still asking for their KV reservation). Taken as they change and after each round."""
        unscheduled = sum(1 for x in self._live.values() if x.scheduled is None)
        joining = sum(self._joining.values())
        self._metrics.census(len(self._live), len(self._live) - unscheduled, unscheduled + joining)

    def _recorded(self, record: StepRecord) -> None:
        """A lane's round ended: its record kept for stats(), the census taken (sequences it scheduled run now)."""
        self._records.append(record)
        self._census()

    async def _reserve(self, index: int, seq_id: str, tokens: int) -> None:
        """Reserve the sequence's KV on the lane's target replica (the one its calls will reach), or Overloaded."""
        key = self._lane_key(index)
        try:
            reserved: Reserved = await self._target.call("reserve", key, seq_id, tokens)
        except BaseException:
            # Cancelled or failed after the replica may have granted it: release it (a no-op if it did not).
            release = self._target.call("unreserve", key, [seq_id])
            task = asyncio.get_running_loop().create_task(release, context=contextvars.Context())
            self._background.add(task)
            task.add_done_callback(self._released)
            raise
        if not reserved.granted and tokens > reserved.budget:  # a replica with less memory than the one asked
            raise ValueError(
                f"max_tokens: the prompt plus max_tokens ({tokens} tokens) exceed the KV budget of target replica "
                f"{reserved.replica}, {reserved.budget} tokens (target_pool.kv_budget_tokens)"
            )
        if not reserved.granted:
            self._metrics.refused("kv_budget")
            raise Overloaded(
                f"KV budget: {reserved.held} of {reserved.budget} tokens reserved on target replica "
                f"{reserved.replica}, and this request needs {tokens} (prompt + max_tokens)"
            )

    def _released(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:  # the replica is gone, and its ledger with it
            logger.info("release of a failed admission's reservation failed: %r", task.exception())

    def _lane_for_new(self) -> int:
        """The index of the lane a new sequence joins: the smallest open one, or a new one. Sequences still
        being admitted count as their lane's, so a burst of requests spreads over lanes as it arrives."""
        sizes = {i: len(lane) for i, lane in self._lanes.items()}
        for i, n in self._joining.items():
            sizes[i] = sizes.get(i, 0) + n
        open_lanes = [i for i, n in sizes.items() if n < self.config.max_lane_sequences]
        if open_lanes or len(sizes) >= self.config.max_lanes:
            return min(open_lanes or sizes, key=lambda i: sizes[i])
        return next(i for i in itertools.count() if i not in sizes)  # reuse names: bounded affinity keys

    def _lane_key(self, index: int) -> str:
        return f"{self.router_id}/lane{index}"

    def _lane(self, index: int) -> Lane:
        """Lane `index`, opened if it is not (or closed while the sequence was being admitted): a lane's calls
        reach the replica its key is pinned to, so the reservation made under the key holds for it."""
        if (lane := self._lanes.get(index)) is not None:
            return lane
        assert self._info is not None, "admission fetches the target's info first"
        ctx = LaneContext(
            self.config,
            self._draft,
            self._target,
            self._info.eos_ids,
            self._decode,
            self._recorded,
            self._metrics,
            self._costs,
            self._drafting,
        )

        def closed(lane: Lane) -> None:
            if self._lanes.get(index) is lane:
                self._lanes.pop(index)

        lane = Lane(self._lane_key(index), ctx, closed)
        self._lanes[index] = lane
        return lane

    async def _target_info(self) -> TargetInfo:
        async with self._info_lock:
            if self._info is None:
                info: TargetInfo = await self._target.call("info", None)
                self._window = served_window(info, await self._draft_info())
                self._info = info
        return self._info

    async def _draft_info(self) -> DraftInfo | None:
        """The draft replicas' limits; None without a draft pool, or when it does not answer within
        draft_timeout_s (it is optional: Serve holds calls to a pool being replaced until a replica is up)."""
        if self._draft is None:
            return None
        try:
            info: DraftInfo = await asyncio.wait_for(self._draft.call("info", None), self.config.draft_timeout_s)
            return info
        except Exception as e:
            logger.warning("the draft pool did not say its limits (%r): the window is the target's", e)
            return None


def served_window(target: TargetInfo, draft: DraftInfo | None) -> ContextWindow:
    """Most prompt + max_tokens one sequence can be given: the models' windows and the replicas' KV budgets."""
    windows = [
        ContextWindow(target.max_model_len, "the target model's max_position_embeddings"),
        ContextWindow(target.kv_budget_tokens, "the KV budget of a target replica, target_pool.kv_budget_tokens"),
    ]
    if draft is not None and draft.max_model_len is not None:
        windows.append(ContextWindow(draft.max_model_len, "the draft model's max_position_embeddings"))
    if draft is not None and draft.kv_budget_tokens is not None:
        windows.append(
            ContextWindow(draft.kv_budget_tokens, "the KV budget of a draft replica, draft_pool.kv_budget_tokens")
        )
    return ContextWindow.smallest(*windows)


def check_window(n_prompt: int, max_tokens: int, window: ContextWindow) -> None:
    """ValueError naming the field when prompt + max_tokens can never fit in `window` (HTTP 400)."""
    if n_prompt >= window.tokens:
        raise ValueError(
            f"prompt_token_ids: {n_prompt} tokens, but the context window is {window.tokens} tokens ({window.limit}), "
            "prompt plus at least one generated token"
        )
    if n_prompt + max_tokens > window.tokens:
        raise ValueError(
            f"max_tokens: {max_tokens} new tokens plus the {n_prompt}-token prompt exceed the context window of "
            f"{window.tokens} tokens ({window.limit}); at most {window.tokens - n_prompt} new tokens fit"
        )


def summarize(records: list[StepRecord]) -> dict[str, Any]:
    if not records:
        return {"rounds": 0}
    n = len(records)
    wall = sum(r.end - r.start for r in records)
    draft = sum(r.draft.seconds for r in records if r.draft)
    verify = sum(r.verify.seconds for r in records if r.verify)
    overhead = sum(r.overhead for r in records)
    hidden = sum(r.draft_hidden[0] for r in records)
    tried = sum(r.ahead_tried for r in records)
    return {
        "rounds": n,
        "step_s": wall / n,
        "draft_s": draft / n,
        "verify_s": verify / n,
        "overhead_s": overhead / n,
        "overhead_share": overhead / wall if wall > 0 else 0.0,
        "tokens": sum(r.tokens for r in records),
        # round ahead: pre-drafts that were the next round's proposal; draft time the verifies hid
        "predraft_sequences": tried,
        "predraft_hit_rate": sum(r.ahead_hits for r in records) / tried if tried else 0.0,
        "predraft_cut_hits": sum(r.ahead_cut_hits for r in records),
        "draft_hidden_share": hidden / (hidden + sum(r.draft_hidden[1] for r in records)) if hidden else 0.0,
        "draft_tokens_unverified": sum(r.unverified for r in records),
        "verified_seqs_per_round": sum(r.verified_seqs for r in records) / n,
        "draft_calls": dict(Counter(r.draft_replica for r in records if r.draft_replica)),
        "verify_calls": dict(Counter(r.target_replica for r in records if r.target_replica)),
    }


def _as_pool(x: Any) -> Pool:
    from ray.serve.handle import DeploymentHandle

    return ServePool(x) if isinstance(x, DeploymentHandle) else x


def _replica_id() -> str | None:
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # not inside a Serve replica
        return None
