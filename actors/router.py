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
import itertools
import uuid
from collections import Counter, deque
from collections.abc import AsyncGenerator, Callable
from typing import Any

from actors.config import RouterConfig
from actors.lane import Lane, LaneContext, Live, StepRecord
from actors.loading import Resolver, identity, load_decoder
from actors.metrics import RouterMetrics
from actors.pools import Pool, ServePool
from actors.wire import TargetInfo
from speculative.load_control import StepCosts
from speculative.sampling import SamplingParams
from speculative.sequence import Sequence


class Overloaded(RuntimeError):
    """The router holds `max_active_sequences` already; retry later (HTTP 429 at the front door)."""


class StreamTimeout(RuntimeError):
    """The request ran past `max_stream_s`: ended with this error (the bound on a router replica's drain)."""


class Router:
    def __init__(
        self,
        config: RouterConfig,
        draft: Pool | Any | None,
        target: Pool | Any,
        tokenizer: str | None = None,
        resolve: Resolver = identity,
        decode: Callable[[list[int]], str] | None = None,
        router_id: str | None = None,
    ) -> None:
        """`draft` / `target`: `Pool`s, or Serve `DeploymentHandle`s (wrapped once, here).

        `decode` (token ids -> text, for stop strings) defaults to the tokenizer at `tokenizer`, if any.
        """
        self.config = config
        self.router_id = router_id or _replica_id() or uuid.uuid4().hex[:8]
        self._draft = None if draft is None else _as_pool(draft)
        self._target = _as_pool(target)
        self._decode = decode if decode is not None or tokenizer is None else load_decoder(tokenizer, resolve)
        self._info: TargetInfo | None = None
        self._info_lock = asyncio.Lock()
        self._lanes: dict[int, Lane] = {}
        self._live: dict[str, Live] = {}
        self._ids = itertools.count()
        self._records: deque[StepRecord] = deque(maxlen=config.stats_window)
        self._metrics = RouterMetrics()
        self._costs = StepCosts(config.depth)  # lanes come and go; what a verify or draft costs here outlives them

    # ---- public API ----------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], sampling: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run one request to completion: token_ids, finish_reason, usage."""
        tokens: list[int] = []
        last: dict[str, Any] = {}
        async for chunk in self.generate_stream(prompt_token_ids, sampling):
            tokens += chunk["token_ids"]
            last = chunk
        return {"token_ids": tokens, "finish_reason": last.get("finish_reason"), "usage": last.get("usage", {})}

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
                    raise RuntimeError(chunk["error"])
                yield chunk
                if chunk["finish_reason"] is not None:
                    return
        finally:
            if live.seq.finish_reason is None:
                self._metrics.requests.inc(1, tags={"finish_reason": "cancelled"})
            live.cancelled = True  # a client that went away: the lane drops it between rounds
            self._live.pop(live.seq.seq_id, None)
            self._metrics.queue.set(len(self._live))

    async def stats(self, reset: bool = False) -> dict[str, Any]:
        """Means over the recorded rounds: step time, draft and target compute, router overhead."""
        records = list(self._records)
        if reset:
            self._records.clear()
        return summarize(records) | {"active": len(self._live), "lanes": len(self._lanes)}

    async def info(self) -> dict[str, Any]:
        info = await self._target_info()
        return {"vocab_size": info.vocab_size, "eos_ids": sorted(info.eos_ids), "model": info.model}

    # ---- admission -----------------------------------------------------------------------
    async def _admit(self, prompt: list[int], sampling: dict[str, Any]) -> Live:
        params = SamplingParams.model_validate(sampling)
        if params.stop and self._decode is None:
            raise ValueError("stop: stop strings need a tokenizer, and this deployment has none")
        info = await self._target_info()
        if not prompt or not isinstance(prompt, list):
            raise ValueError("prompt_token_ids: must be a non-empty list of token ids")
        if any(not isinstance(t, int) or not 0 <= t < info.vocab_size for t in prompt):
            raise ValueError(f"prompt_token_ids: token ids must be integers in 0..{info.vocab_size - 1}")
        if len(self._live) >= self.config.max_active_sequences:
            raise Overloaded(f"{len(self._live)} sequences active (max_active_sequences)")
        seq_id = f"{self.router_id}-{next(self._ids)}"
        seq = Sequence(seq_id, list(prompt), params)
        live = Live(seq)
        self._live[seq_id] = live
        self._metrics.queue.set(len(self._live))
        self._lane_for_new().add(live)
        return live

    def _lane_for_new(self) -> Lane:
        open_lanes = [lane for lane in self._lanes.values() if len(lane) < self.config.max_lane_sequences]
        if open_lanes or len(self._lanes) >= self.config.max_lanes:
            return min(open_lanes or self._lanes.values(), key=len)
        index = next(i for i in itertools.count() if i not in self._lanes)  # reuse names: bounded affinity keys
        assert self._info is not None, "admission fetches the target's info first"
        ctx = LaneContext(
            self.config,
            self._draft,
            self._target,
            self._info.eos_ids,
            self._decode,
            self._records.append,
            self._metrics,
            self._costs,
        )

        def closed(lane: Lane) -> None:
            self._lanes.pop(index, None)

        lane = Lane(f"{self.router_id}/lane{index}", ctx, closed)
        self._lanes[index] = lane
        return lane

    async def _target_info(self) -> TargetInfo:
        async with self._info_lock:
            if self._info is None:
                self._info = await self._target.call("info", None)
        return self._info


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
