"""A lane: the router's draft/verify/commit loop over a micro-batch pair, pinned to one replica per pool.

With pipelining a lane splits its sequences into two groups and plays ping-pong: each round the
target verifies the group that was drafted last round while the draft pool drafts the other,

    round 1:  draft A
    round 2:  verify A  |  draft B
    round 3:  verify B  |  draft A      (A committed in round 2, B waits for its verdict)
    ...

so neither pool waits for the other unless one is slower (then it sets the pace: a round takes
max(V, D) instead of V + D). Without pipelining there is one group and a round is draft, then
verify; so is a round with pipelining while only one group holds sequences.

Sequences join between rounds (into the smaller group; a sequence joining the group that is
already drafted is verified with an empty tree, which prefills it and yields one token) and leave
when a stop condition hits or the client goes away; the workers forget them through `release`
lists carried by the next call of that group.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from actors.config import RouterConfig
from actors.metrics import RouterMetrics
from actors.pools import Pool, replica_lost
from actors.wire import Drafted, Verified, WireProposal, WireVerifyItem, Work
from speculative.decoder import Sequence
from speculative.drafters.base import DraftRequest
from speculative.drafters.lookup import PromptLookupDrafter, split_lookup
from speculative.load_control import Planned, StepCosts, plan_depths
from speculative.tree import TokenTree

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Live:
    """A sequence in flight: the router's state (the source of truth) and its client's queue."""

    seq: Sequence
    chunks: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)
    proposal: WireProposal | None = None  # drafted, not yet verified
    cancelled: bool = False
    admitted: float = field(default_factory=time.time)
    last_emit: float | None = None  # when the client last got tokens


@dataclass(frozen=True)
class StepRecord:
    """One round of one lane, for the router's stats."""

    start: float
    end: float
    draft: Work | None
    verify: Work | None
    drafted_seqs: int
    verified_seqs: int
    tokens: int  # tokens committed
    draft_replica: str | None = None
    target_replica: str | None = None

    @property
    def overhead(self) -> float:
        """Seconds of the round in neither draft nor target compute (Ray hops, Python, waiting)."""
        spans = sorted((max(w.start, self.start), min(w.end, self.end)) for w in (self.draft, self.verify) if w)
        covered, reach = 0.0, self.start
        for lo, hi in spans:
            lo = max(lo, reach)
            if hi > lo:
                covered, reach = covered + hi - lo, hi
        return max(self.end - self.start - covered, 0.0)


@dataclass
class _Half:
    """What one side of a round did: a draft call or a verify call."""

    work: Work | None = None
    seqs: int = 0
    tokens: int = 0
    replica: str | None = None


@dataclass
class LaneContext:
    """What every lane of a router shares."""

    config: RouterConfig
    draft: Pool | None  # None: no drafter, plain decoding
    target: Pool
    eos_ids: frozenset[int]
    decode: Callable[[list[int]], str] | None
    record: Callable[[StepRecord], None]
    metrics: RouterMetrics
    costs: StepCosts  # measured verify / draft costs, shared by the router's lanes


class Lane:
    def __init__(self, key: str, ctx: LaneContext, on_done: Callable[[Lane], None]) -> None:
        self.key, self.ctx, self._on_done = key, ctx, on_done
        # Nothing to overlap without a draft pool to call: none, or prompt lookup alone (drafted here).
        pool_drafts = ctx.draft is not None and (ctx.config.lookup_ngrams is None or ctx.config.lookup_quotes_only)
        n = 2 if ctx.config.pipelining and pool_drafts else 1
        self.groups: list[dict[str, Live]] = [{} for _ in range(n)]
        self.drafted = [False] * n  # group holds proposals not yet verified
        self.release_draft: list[list[str]] = [[] for _ in range(n)]
        # per group, the planned round's expected tokens (StepCosts.last_predicted; None: plain)
        self.predicted: list[Planned | None] = [None] * n
        self.release_target: list[list[str]] = [[] for _ in range(n)]
        self.target_waiting = 0  # verify calls queued at our target replica, as last reported
        self._draft_off_until = 0.0
        ngrams = ctx.config.lookup_ngrams  # prompt lookup, drafted here: no call, and depths know each match
        self.lookup = PromptLookupDrafter(*ngrams) if ngrams is not None else None
        self.quotes_only = ctx.config.lookup_quotes_only  # lookup beside a draft model: quotes only
        self.task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return sum(len(g) for g in self.groups)

    def cache_key(self, group: int) -> str:
        return f"{self.key}/{group}"

    def add(self, live: Live) -> None:
        g = min(range(len(self.groups)), key=lambda i: (len(self.groups[i]), self.drafted[i]))
        self.groups[g][live.seq.seq_id] = live
        if self.task is None:
            # A fresh context: the lane serves many requests, so its calls must not inherit the request
            # context of the one that opened it (Serve cancels a request's handle calls with it, which
            # would kill the lane, and every sequence in it, when that one client disconnects).
            self.task = asyncio.get_running_loop().create_task(self.run(), context=contextvars.Context())

    # ---- the loop ----------------------------------------------------------------------
    async def run(self) -> None:
        try:
            while True:
                self._sweep()
                if not len(self):
                    await self._flush_releases()
                    if not len(self):
                        break
                    continue
                await self._round()
        except Exception as e:  # a bug: end the lane's requests with the error instead of hanging them
            logger.exception("lane %s failed", self.key)
            for g in range(len(self.groups)):
                self._fail(g, f"internal error: {e!r}")
        finally:
            self._on_done(self)

    async def _round(self) -> None:
        start = time.time()
        busy = [g for g, group in enumerate(self.groups) if group]
        if len(busy) == 1:  # nothing to overlap with: draft and verify in one round
            g = busy[0]
            draft = await self._draft(g) if not self.drafted[g] else None
            verify = await self._verify(g)
        else:
            vg = next((g for g in (0, 1) if self.drafted[g] and self.groups[g]), None)
            dg = next((g for g in (0, 1) if not self.drafted[g] and self.groups[g] and g != vg), None)
            draft, verify = await asyncio.gather(self._draft(dg), self._verify(vg))
        d, v = draft or _Half(), verify or _Half()
        self.ctx.record(StepRecord(start, time.time(), d.work, v.work, d.seqs, v.seqs, v.tokens, d.replica, v.replica))

    def _sweep(self) -> None:
        """Drop cancelled sequences between rounds (no call is in flight)."""
        for g, group in enumerate(self.groups):
            for live in [x for x in group.values() if x.cancelled]:
                self._leave(g, live)

    # ---- draft -------------------------------------------------------------------------
    def depth_cap(self, n: int) -> int:
        """Most draft tokens per sequence for a micro-batch of n: shrinks with batch size and load."""
        limits = self.ctx.config.limits
        cap = min(limits.adaptive.max_depth, max(limits.verify_token_budget // max(n, 1) - 1, 0))
        return cap >> self.target_waiting if limits.shrink_when_queued else cap

    async def _draft(self, g: int | None) -> _Half | None:
        if g is None:
            return None
        lives = list(self.groups[g].values())
        config = self.ctx.config
        costs = self.ctx.costs if config.limits.load_adaptive else None
        overlapped = len(self.groups) > 1 and all(self.groups)  # the other group's verify runs beside this draft
        seqs = [x.seq for x in lives]
        depths = plan_depths(
            seqs, costs, self.depth_cap(len(lives)), overlapped, config.drafts_sampled, self.lookup, self.quotes_only
        )
        self.predicted[g] = costs.last_predicted if costs is not None else None
        requests = [DraftRequest(s.seq_id, tuple(s.tokens), d, s.params) for s, d in zip(seqs, depths, strict=True)]
        self.ctx.metrics.depth.set(sum(r.budget for r in requests) / max(len(requests), 1))
        # Prompt lookup drafts here, in the router (~0.1 ms a sequence): a call to the draft pool would
        # cost more than the lookup. `plan_depths` set lookup_run for the sequences lookup drafts.
        found, modelled = split_lookup(self.lookup, [s.stats.lookup_run for s in seqs], requests)
        proposals = [WireProposal.encode(p) if p is not None else None for p in found]
        half = _Half(seqs=len(lives))
        pool, called_pool = self.ctx.draft, False
        if pool is not None and time.time() >= self._draft_off_until and any(r.budget for r in modelled):
            try:
                called = time.perf_counter()
                drafted: Drafted = await asyncio.wait_for(
                    pool.call("propose", self.key, self.cache_key(g), modelled, self.release_draft[g]),
                    self.ctx.config.draft_timeout_s,
                )
                self.release_draft[g] = []
                half.work, half.replica, called_pool = drafted.work, drafted.replica, True
                # Priced as the round waits for it, the call included: only drafting rounds pay for the
                # hop to the draft pool.
                waited = time.perf_counter() - called
                self.ctx.costs.observe_draft(seqs, [p.tree for p in drafted.proposals], waited, self.predicted[g])
                proposals = [p or d for p, d in zip(proposals, drafted.proposals, strict=True)]
            except Exception as e:  # a draft failure never fails a request: decode without speculation
                logger.warning("lane %s: draft call failed (%r); no speculation for a while", self.key, e)
                self._draft_off_until = time.time() + self.ctx.config.draft_backoff_s
        if any(r.budget for r in modelled) and not called_pool:  # not drafted as planned: no calibrating on it
            self.predicted[g] = None
        for live, proposal in zip(lives, proposals, strict=True):
            live.proposal = proposal
        self.drafted[g] = True
        return half

    # ---- verify and commit -------------------------------------------------------------
    async def _verify(self, g: int | None) -> _Half | None:
        if g is None:
            return None
        lives = list(self.groups[g].values())
        items = [
            WireVerifyItem(x.seq.seq_id, tuple(x.seq.tokens), x.seq.params, x.proposal or _empty(x.seq)) for x in lives
        ]
        verified = await self._verify_call(g, items)
        self.drafted[g] = False
        if verified is None:
            self._fail(g, "target pool unavailable")
            return _Half(seqs=len(lives))
        self.target_waiting = verified.waiting
        trees = [item.proposal.tree for item in items]
        accepted = [len(v.accepted) for v in verified.verdicts]
        self.ctx.costs.observe_verify([x.seq for x in lives], trees, verified.work.seconds, accepted)
        self.ctx.costs.observe_round(self.predicted[g], sum(len(v.tokens) for v in verified.verdicts))
        committed = 0
        for live, verdict in zip(lives, verified.verdicts, strict=True):
            committed += self._commit(g, live, verdict.tokens, len(verdict.accepted))
        return _Half(verified.work, len(lives), committed, verified.replica)

    async def _verify_call(self, g: int, items: list[WireVerifyItem]) -> Verified | None:
        for attempt in range(self.ctx.config.verify_retries + 1):
            try:
                verified: Verified = await self.ctx.target.call(
                    "verify", self.key, self.cache_key(g), items, self.release_target[g]
                )
                self.release_target[g] = []
                return verified
            except Exception as e:  # the replica was lost: retry; Serve routes to a live one, which re-prefills
                logger.warning("lane %s: verify attempt %d failed: %r", self.key, attempt + 1, e)
                if not replica_lost(e):
                    break
                await asyncio.sleep(min(0.5 * 2**attempt, 5.0))
        return None

    def _commit(self, g: int, live: Live, tokens: tuple[int, ...], n_accepted: int) -> int:
        seq = live.seq
        tree = live.proposal.tree if live.proposal is not None else None
        live.proposal = None
        new = seq.commit(tree, tokens, n_accepted, self.ctx.eos_ids, self.ctx.decode)
        now = time.time()
        self.ctx.metrics.step(tree.depths if tree else (0,), n_accepted, len(new), now, live)
        if seq.finish_reason is not None:
            self.ctx.metrics.finished(
                seq.finish_reason, seq.stats.acceptance_length, len(seq.output), now - live.admitted
            )
            live.chunks.put_nowait({"token_ids": new, "finish_reason": seq.finish_reason, "usage": usage(seq)})
            self._leave(g, live)
        elif new:
            live.chunks.put_nowait({"token_ids": new, "finish_reason": None})
        return len(new)

    def _leave(self, g: int, live: Live) -> None:
        seq_id = live.seq.seq_id
        self.groups[g].pop(seq_id, None)
        self.release_draft[g].append(seq_id)
        self.release_target[g].append(seq_id)

    def _fail(self, g: int, message: str) -> None:
        for live in list(self.groups[g].values()):
            self.ctx.metrics.finished("error", 0.0, 0, 0.0)
            live.chunks.put_nowait({"error": message})
            self._leave(g, live)

    async def _flush_releases(self) -> None:
        """The lane is empty: tell the workers now instead of on a next call that will not come."""
        for g in range(len(self.groups)):
            for pool, pending in ((self.ctx.draft, self.release_draft), (self.ctx.target, self.release_target)):
                ids, pending[g] = pending[g], []
                if pool is not None and ids:
                    try:
                        await pool.call("release", self.key, self.cache_key(g), ids)
                    except Exception as e:  # soft state: the worker evicts idle groups anyway
                        logger.info("lane %s: release failed (%r)", self.key, e)


def _empty(seq: Sequence) -> WireProposal:
    return WireProposal(TokenTree.chain(seq.tokens[-1], []), None)


def usage(seq: Sequence) -> dict[str, Any]:
    return {
        "prompt_tokens": len(seq.prompt),
        "completion_tokens": len(seq.output),
        "steps": seq.stats.steps,
        "drafted": seq.stats.drafted,
        "accepted": seq.stats.accepted,
        "acceptance_length": seq.stats.acceptance_length,
    }
