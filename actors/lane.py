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

Round ahead (`speculative/ahead.py`): while a group is verified, the draft pool pre-drafts that
group's next round from the continuation it expects, for a group of one sequence (at one stream
nothing else would overlap) and for every sequence in its prefill round (the draft model catches
up on the prompt beside the target's prefill, never before the first token nor after it; a prompt
over `router.ahead_prefill_tokens` is left to the depth controller, which prices its catch-up). When
the verdict matches, the next verify starts at once with that draft; when not, the sequence is
drafted again at the next round's start. The round waits for a pre-draft at most as long as its
verify took; a later one is dropped, and the pool is not called again until it has answered.

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
from dataclasses import dataclass, field, replace
from typing import Any

from actors.config import RouterConfig
from actors.metrics import RouterMetrics
from actors.pools import Pool, replica_lost, verify_failure
from actors.wire import Drafted, Verified, WireProposal, WireVerifyItem, Work
from speculative.ahead import ahead_request, assumed_path, take_ahead
from speculative.costs import Planned, StepCosts
from speculative.drafters.base import DraftRequest
from speculative.drafters.lookup import PromptLookupDrafter
from speculative.round import Speculation
from speculative.sequence import Sequence
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
    draft_seen: int = 0  # tokens of it the draft pool was last sent (what a call's catch-up is counted from)


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
    ahead: Work | None = None  # the pre-draft made beside this round's verify, if it answered in the round
    ahead_tried: int = 0  # sequences pre-drafted
    ahead_hits: int = 0  # of them, those whose pre-draft is the next round's proposal
    unverified: int = 0  # pre-drafted tokens that will never be verified (misses, other guesses)

    @property
    def draft_hidden(self) -> tuple[float, float]:
        """(draft compute seconds beside this round's verify, the rest): what overlap hid."""
        hidden = total = 0.0
        for w in (self.draft, self.ahead):
            if w is None:
                continue
            total += w.seconds
            if self.verify is not None:
                hidden += max(min(w.end, self.verify.end) - max(w.start, self.verify.start), 0.0)
        return hidden, total - hidden

    @property
    def overhead(self) -> float:
        """Seconds of the round in neither draft nor target compute (Ray hops, Python, waiting)."""
        works = (self.draft, self.verify, self.ahead)
        spans = sorted((max(w.start, self.start), min(w.end, self.end)) for w in works if w)
        covered, reach = 0.0, self.start
        for lo, hi in spans:
            lo = max(lo, reach)
            if hi > lo:
                covered, reach = covered + hi - lo, hi
        return max(self.end - self.start - covered, 0.0)


@dataclass
class _Half:
    """What one side of a round did: a draft call or a verify call (with its pre-draft, if any)."""

    work: Work | None = None
    seqs: int = 0
    tokens: int = 0
    replica: str | None = None
    ahead: _Settled | None = None


@dataclass
class _Ahead:
    """A pre-draft in flight: the next round's drafts for some of a group's sequences."""

    group: int
    task: asyncio.Task[Drafted]
    lives: list[Live]
    paths: list[list[int]]  # per live, the draft tokens the pre-draft assumes accepted
    released: list[str]  # sequence ids the call tells the worker to forget (restored if it fails)


@dataclass(frozen=True)
class _Settled:
    """How a pre-draft ended within its round."""

    work: Work
    tried: int
    hits: int
    unverified: int


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
        pool_drafts = ctx.draft is not None and (ctx.config.lookup_ngrams is None or ctx.config.lookup_quotes)
        n = 2 if ctx.config.pipelining and pool_drafts else 1
        self.groups: list[dict[str, Live]] = [{} for _ in range(n)]
        self.drafted = [False] * n  # group holds proposals not yet verified
        self.release_draft: list[list[str]] = [[] for _ in range(n)]
        # per group, the planned round's prediction (`Plan.predicted`; None: not a priced round)
        self.predicted: list[Planned | None] = [None] * n
        self.release_target: list[list[str]] = [[] for _ in range(n)]
        self.target_waiting = 0  # verify calls queued at our target replica, as last reported
        self._draft_off_until = 0.0
        config, ngrams = ctx.config, ctx.config.lookup_ngrams
        # Prompt lookup is drafted here (no call) and depths know each match; beside a draft model, quotes only.
        lookup = PromptLookupDrafter(*ngrams) if ngrams is not None else None
        self.speculation = Speculation(
            config.depth, ctx.costs, config.drafts_sampled, lookup, config.lookup_quotes, ctx.eos_ids, ctx.decode
        )
        self.round_ahead = ctx.config.round_ahead and pool_drafts
        self._late: asyncio.Task[Drafted] | None = None  # a pre-draft that outlived its round
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
            verify = await self._verify(g, ahead=self.round_ahead)
        else:
            vg = next((g for g in (0, 1) if self.drafted[g] and self.groups[g]), None)
            dg = next((g for g in (0, 1) if not self.drafted[g] and self.groups[g] and g != vg), None)
            draft, verify = await asyncio.gather(self._draft(dg), self._verify(vg))
        d, v = draft or _Half(), verify or _Half()
        a = v.ahead
        record = StepRecord(start, time.time(), d.work, v.work, d.seqs, v.seqs, v.tokens, d.replica, v.replica)
        if a is not None:
            record = replace(record, ahead=a.work, ahead_tried=a.tried, ahead_hits=a.hits, unverified=a.unverified)
        self.ctx.record(record)
        self.ctx.metrics.draft_time(*record.draft_hidden)

    def _sweep(self) -> None:
        """Drop cancelled sequences between rounds (no call is in flight)."""
        for g, group in enumerate(self.groups):
            for live in [x for x in group.values() if x.cancelled]:
                self._leave(g, live)

    # ---- draft -------------------------------------------------------------------------
    async def _draft(self, g: int | None) -> _Half | None:
        if g is None:
            return None
        group = list(self.groups[g].values())
        lives = [x for x in group if x.proposal is None]  # the others hold their pre-drafts
        # The other group's verify runs beside this draft; or, for one sequence drafting round ahead, this
        # round's draft is the exception (a miss) and the next is drafted beside the verify.
        overlapped = (len(self.groups) > 1 and all(self.groups)) or (self.round_ahead and len(group) == 1)
        seqs = [x.seq for x in lives]
        drafting = self.speculation.plan(seqs, len(group), self.target_waiting, overlapped)
        # A round mixing pre-drafts with these drafts is not the round this plan priced: no calibrating on it.
        self.predicted[g] = drafting.plan.predicted if len(lives) == len(group) else None
        modelled = drafting.modelled
        self.ctx.metrics.depth.set(sum(drafting.plan.depths) / max(len(seqs), 1))
        # Prompt lookup drafts here, in the router (~0.1 ms a sequence): a call to the draft pool would
        # cost more than the lookup.
        proposals = [WireProposal.encode(p) if p is not None else None for p in drafting.found]
        half = _Half(seqs=len(lives))
        pool, called_pool = self.ctx.draft, False
        if self._pool_free() and pool is not None and drafting.calls_drafter:
            try:
                called = time.perf_counter()
                work = sum(_work(x, r) for x, r in zip(lives, modelled, strict=True) if r.budget)
                drafted: Drafted = await asyncio.wait_for(
                    pool.call("propose", self.key, self.cache_key(g), modelled, self.release_draft[g]),
                    self._deadline(work),
                )
                self.release_draft[g] = []
                half.work, half.replica, called_pool = drafted.work, drafted.replica, True
                # Priced as the round waits for it, the call included: only drafting rounds pay for the
                # hop to the draft pool.
                waited = time.perf_counter() - called
                self.speculation.drafted(seqs, [p.tree for p in drafted.proposals], waited, self.predicted[g])
                proposals = [p or d for p, d in zip(proposals, drafted.proposals, strict=True)]
            except Exception as e:  # a draft failure never fails a request: decode without speculation
                self._draft_failed(e)
        if drafting.calls_drafter and not called_pool:  # not drafted as planned: no calibrating on it
            self.predicted[g] = None
        for live, proposal in zip(lives, proposals, strict=True):
            live.proposal = proposal
        self.drafted[g] = True
        return half

    def _pool_free(self) -> bool:
        """The draft pool may be called: no backoff after a failure, no pre-draft of ours still running."""
        if self._late is not None and self._late.done():
            self._late = None
        return self._late is None and time.time() >= self._draft_off_until

    def _deadline(self, work_tokens: int) -> float:
        """Seconds a draft call carrying this many tokens (to catch up on and to draft) may take before it
        counts as failed: sized to the work, so slow is not lost."""
        config = self.ctx.config
        return config.draft_timeout_s + config.draft_timeout_per_token_s * work_tokens

    def _draft_failed(self, error: BaseException) -> None:
        logger.warning("lane %s: draft call failed (%r); no speculation for a while", self.key, error)
        self._draft_off_until = time.time() + self.ctx.config.draft_backoff_s

    # ---- round ahead ---------------------------------------------------------------------
    def _ahead_depth(self, live: Live, group_size: int) -> int:
        """How deep to pre-draft this sequence's next round (0: not at all).

        A sequence in its prefill round drafts its own first depth (its want within the lane's cap), if
        its prompt is no longer than `ahead_prefill_tokens` (a longer catch-up would hold the draft
        replica, and every other sequence's drafts, for many rounds);
        one drafting alone in its group drafts what the planner chooses for its next round, priced as
        overlapped (a hit hides the draft behind the verify); others are planned at their round's
        start. Only sequences whose tokens do not depend on the draft (greedy, deterministic drafts)
        pre-draft, and not those the router drafts by lookup itself (free, at the round's start).
        """
        seq, config, speculation = live.seq, self.ctx.config, self.speculation
        if not (seq.params.greedy or not config.drafts_sampled):
            return 0
        tree = live.proposal.tree if live.proposal is not None else None
        if not seq.stats.steps:  # prefill: once (a long prompt's later chunk rounds find the draft caught up)
            if not 0 < len(seq.tokens) - live.draft_seen <= config.ahead_prefill_tokens:
                return 0
            depth = speculation.own(seq, group_size, self.target_waiting)
        elif group_size == 1 and tree is not None and tree.size:
            # priced as drafted: beside the verify, one forward deeper (the guess of the bonus comes first)
            plan = speculation.depths([seq], 1, self.target_waiting, overlapped=True, extra_levels=1)
            if speculation.lookup is not None and plan.runs[0]:  # a quote: drafted by lookup at the round's start
                return 0
            depth = plan.depths[0]
        else:
            return 0
        path = len(assumed_path(tree)) if tree is not None else 0
        own = seq.params.max_draft_tokens if seq.params.max_draft_tokens is not None else depth
        # After a hit this round commits path + bonus; the next then adds at least one token.
        return max(min(depth, own, seq.params.max_tokens - len(seq.output) - path - 2), 0)

    def _start_ahead(self, g: int, lives: list[Live]) -> _Ahead | None:
        """Send the pre-drafts of this group's next round, beside the verify about to start."""
        pool = self.ctx.draft
        if pool is None or not self._pool_free():
            return None
        picked = [(x, d) for x in lives if (d := self._ahead_depth(x, len(lives)))]
        if not picked:
            return None
        requests, paths, work = [], [], 0
        for live, depth in picked:
            seq = live.seq
            tree = live.proposal.tree if live.proposal is not None else _empty(seq).tree
            request = ahead_request(seq.seq_id, tuple(seq.tokens), tree, depth, seq.params)
            requests.append(request)
            paths.append(assumed_path(tree))
            work += _work(live, request)
            # What the draft model will have seen: the load planner's catch-up accounting (`catch_up`).
            stats = seq.stats
            stats.draft_synced, stats.drafted_at, stats.draft_catch_up = len(request.tokens), stats.steps, 0
        released, self.release_draft[g] = self.release_draft[g], []
        call = pool.call("propose", self.key, self.cache_key(g), requests, released)
        task = asyncio.get_running_loop().create_task(asyncio.wait_for(call, self._deadline(work)))
        return _Ahead(g, task, [x for x, _ in picked], paths, released)

    def _drop(self, pre: _Ahead) -> None:
        """Leave a pre-draft to finish unused; the pool is not called until it has answered."""
        self._late = pre.task
        pre.task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning

    async def _settle_ahead(
        self, pre: _Ahead, verify_s: float, committed: dict[str, tuple[int, ...]]
    ) -> _Settled | None:
        """Take the pre-drafts that the verdicts (`committed`: each sequence's verdict tokens) matched.

        Waits at most `verify_s` (the verify's own duration) for the pre-draft; a later one is left to
        finish, its drafts dropped (the pool is not called again until it answers). When every sequence
        of it is still prefilling (a chunk of a long prompt), nothing of it can be taken: the next chunk's
        round starts at once, and the draft model's catch-up goes on beside it."""
        if not any(committed.get(x.seq.seq_id) for x in pre.lives):
            self._drop(pre)
            self.ctx.metrics.ahead(len(pre.lives), 0, "settled")  # misses: drafted for a prompt not yet done
            return None
        done, _ = await asyncio.wait({pre.task}, timeout=verify_s)
        if not done:
            self._drop(pre)
            self.ctx.metrics.ahead(len(pre.lives), 0, "late")
            return None
        try:
            drafted = pre.task.result()
        except Exception as e:
            self.release_draft[pre.group] += pre.released
            self._draft_failed(e)
            return None
        group, hits, unverified = self.groups[pre.group], 0, 0
        for live, path, wire in zip(pre.lives, pre.paths, drafted.proposals, strict=True):
            verdict = committed.get(live.seq.seq_id)  # () while still prefilling
            alive = bool(verdict) and live.seq.seq_id in group and live.seq.finish_reason is None
            taken = take_ahead(wire.decode(), path, verdict) if alive and verdict else None
            unverified += wire.tree.size - (taken.tree.size if taken is not None else 0)
            if taken is not None:
                live.proposal, hits = WireProposal.encode(taken), hits + 1
        self.drafted[pre.group] = bool(group) and all(x.proposal is not None for x in group.values())
        self.ctx.metrics.ahead(len(pre.lives), hits, "settled", unverified)
        return _Settled(drafted.work, len(pre.lives), hits, unverified)

    # ---- verify and commit -------------------------------------------------------------
    async def _verify(self, g: int | None, ahead: bool = False) -> _Half | None:
        if g is None:
            return None
        lives = list(self.groups[g].values())
        items = [
            WireVerifyItem(x.seq.seq_id, tuple(x.seq.tokens), x.seq.params, x.proposal or _empty(x.seq), _kv(x.seq))
            for x in lives
        ]
        pre = self._start_ahead(g, lives) if ahead else None
        verified = await self._verify_call(g, items)
        self.drafted[g] = False
        if isinstance(verified, str):
            self._fail(g, verified)
            if pre is not None:  # its drafts are for sequences that just failed
                self._drop(pre)
            return _Half(seqs=len(lives))
        self.target_waiting = verified.waiting
        seqs, trees = [x.seq for x in lives], [item.proposal.tree for item in items]
        news = self.speculation.settle(seqs, trees, verified.verdicts, verified.work.seconds, self.predicted[g])
        committed = 0
        for live, tree, verdict, new in zip(lives, trees, verified.verdicts, news, strict=True):
            live.proposal = None
            if new is not None:  # (None: still prefilling, sent again next round)
                committed += self._emit(g, live, tree, len(verdict.accepted), new)
        half = _Half(verified.work, len(lives), committed, verified.replica)
        if pre is not None:  # the verdicts are streamed already: a pre-draft never delays a token
            verdicts = {x.seq.seq_id: v.tokens for x, v in zip(lives, verified.verdicts, strict=True)}
            half.ahead = await self._settle_ahead(pre, verified.work.seconds, verdicts)
        return half

    async def _verify_call(self, g: int, items: list[WireVerifyItem]) -> Verified | str:
        """The verdicts, or why the verify failed for good (retries spent, or an error retrying cannot fix)."""
        error: BaseException | None = None
        for attempt in range(self.ctx.config.verify_retries + 1):
            try:
                verified: Verified = await self.ctx.target.call(
                    "verify", self.key, self.cache_key(g), items, self.release_target[g]
                )
                self.release_target[g] = []
                return verified
            except Exception as e:  # the replica was lost: retry; Serve routes to a live one, which re-prefills
                logger.warning("lane %s: verify attempt %d failed: %r", self.key, attempt + 1, e)
                error = e
                if not replica_lost(e):
                    break
                await asyncio.sleep(min(0.5 * 2**attempt, 5.0))
        return verify_failure(error)

    def _emit(self, g: int, live: Live, tree: TokenTree, n_accepted: int, new: list[int]) -> int:
        """Stream a settled verdict's new tokens to the client; a finished sequence leaves the lane."""
        seq, now = live.seq, time.time()
        self.ctx.metrics.step(tree.depths, n_accepted, len(new), now, live)
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


def _work(live: Live, request: DraftRequest) -> int:
    """Tokens a draft call computes for this request: those the pool has not seen, then the drafts; and
    from now on the pool has seen the request's tokens."""
    work = max(len(request.tokens) - live.draft_seen, 1) + request.budget
    live.draft_seen = len(request.tokens)
    return work


def _kv(seq: Sequence) -> int:
    """KV tokens reserved for the sequence at admission (actors/admission.py): prompt plus max_tokens."""
    return len(seq.prompt) + seq.params.max_tokens


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
