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

Round ahead (`actors/round_ahead.py`): while a group is verified, the draft pool may pre-draft its
next round; a pre-draft the verdict matches is the next round's proposal. A sequence alone in its
group verifies its second round undrafted, the draft model catching up on its prompt beside it.

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

from actors.config import RouterConfig
from actors.draft_calls import DraftCalls, InFlight, send_work
from actors.metrics import RouterMetrics
from actors.pools import Pool, replica_lost, verify_failure
from actors.records import Live, StepRecord, bare_proposal, usage, with_logprobs
from actors.round_ahead import RoundAhead, Settled
from actors.wire import Drafted, Verified, WireProposal, WireVerifyItem, Work
from speculative.drafters.heads import NextTree, TreeDrafter
from speculative.drafters.lookup import PromptLookupDrafter
from speculative.planning.costs import Planned, StepCosts
from speculative.planning.round import Drafting, Speculation
from speculative.planning.sequence import Sequence
from speculative.rules.tree import TokenTree

logger = logging.getLogger(__name__)


@dataclass
class _Half:
    """What one side of a round did: a draft call or a verify call (with its pre-draft, if any)."""

    work: Work | None = None
    seqs: int = 0
    tokens: int = 0
    replica: str | None = None
    ahead: Settled | None = None


@dataclass(eq=False)
class _Group:
    """One group of a lane's sequences (ping-pong plays two) and what its round in flight carries."""

    index: int  # its place in the lane (the draft calls' release lists are per group)
    key: str  # the workers' cache key for it
    lives: dict[str, Live] = field(default_factory=dict)  # seq_id -> the sequence, in join order
    drafted: bool = False  # holds proposals not yet verified
    predicted: Planned | None = None  # the planned round's prediction (`Plan.predicted`; None: not a priced round)
    release_target: list[str] = field(default_factory=list)  # ids the next verify call tells the target to forget


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
    drafting: InFlight  # draft calls in flight from the router's lanes


class Lane:
    """One lane's sequences in their groups, and the loop that drafts, verifies and commits them."""

    def __init__(self, key: str, ctx: LaneContext, on_done: Callable[[Lane], None]) -> None:
        self.key, self.ctx, self._on_done = key, ctx, on_done
        # Nothing to overlap without a draft pool to call: none, or prompt lookup alone (drafted here).
        pool_drafts = ctx.draft is not None and (ctx.config.lookup_ngrams is None or ctx.config.lookup_quotes)
        n = 2 if ctx.config.pipelining and pool_drafts else 1
        self.groups = [_Group(g, f"{key}/{g}") for g in range(n)]
        self.calls = DraftCalls(ctx.draft, key, n, ctx.config, ctx.drafting)
        self.target_waiting = 0  # verify calls queued at our target replica, as last reported
        config, ngrams = ctx.config, ctx.config.lookup_ngrams
        # Prompt lookup is drafted here (no call) and depths know each match; beside a draft model, quotes only.
        lookup = PromptLookupDrafter(*ngrams) if ngrams is not None else None
        # Medusa, EAGLE: the target's heads drafted the next round's tree with each verdict; the lane cuts it.
        self.trees: dict[str, NextTree] = {}
        self.on_target = TreeDrafter(self.trees) if config.drafts_on_target else None
        self.speculation = Speculation(
            config.depth,
            ctx.costs,
            config.drafts_sampled,
            lookup,
            config.lookup_quotes,
            ctx.eos_ids,
            ctx.decode,
            free_drafts=self.on_target is not None,
        )
        self.round_ahead = ctx.config.round_ahead and pool_drafts
        self.ahead = RoundAhead(self.calls, config, ctx.metrics, self.speculation)
        self.task: asyncio.Task[None] | None = None
        self._releasing: set[asyncio.Task[None]] = set()  # releases of idle groups on their way

    def __len__(self) -> int:
        return sum(len(g.lives) for g in self.groups)

    def add(self, live: Live) -> None:
        group = min(self.groups, key=lambda g: (len(g.lives), g.drafted))
        group.lives[live.seq.seq_id] = live
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
                self._release_idle()
        except Exception as e:  # a bug: end the lane's requests with the error instead of hanging them
            logger.exception("lane %s failed", self.key)
            for group in self.groups:
                self._fail(group, f"internal error: {e!r}")
        finally:
            self._on_done(self)

    async def _round(self) -> None:
        start = time.time()
        busy = [g for g in self.groups if g.lives]
        if len(busy) == 1:  # nothing to overlap with: draft and verify in one round
            group = busy[0]
            draft = await self._draft(group, ahead=self.round_ahead) if not group.drafted else None
            verify = await self._verify(group, ahead=self.round_ahead)
        else:
            vg = next((g for g in self.groups if g.drafted and g.lives), None)
            dg = next((g for g in self.groups if not g.drafted and g.lives and g is not vg), None)
            draft, verify = await asyncio.gather(self._draft(dg), self._verify(vg))
        d, v = draft or _Half(), verify or _Half()
        a = v.ahead
        record = StepRecord(start, time.time(), d.work, v.work, d.seqs, v.seqs, v.tokens, d.replica, v.replica)
        if a is not None:
            record = replace(
                record,
                ahead=a.work,
                ahead_tried=a.tried,
                ahead_hits=a.hits,
                ahead_cut_hits=a.cut_hits,
                unverified=a.unverified,
            )
        self.ctx.record(record)
        self.ctx.metrics.draft_time(*record.draft_hidden)

    def _sweep(self) -> None:
        """Drop cancelled sequences between rounds (no call is in flight)."""
        for group in self.groups:
            for live in [x for x in group.lives.values() if x.cancelled]:
                self._leave(group, live)

    # ---- draft: plan, propose, record --------------------------------------------------
    async def _draft(self, group: _Group | None, ahead: bool = False) -> _Half | None:
        if group is None:
            return None
        if ahead and len(group.lives) == 1 and self.ahead.catches_up(next(iter(group.lives.values()))):
            # the draft model catches up beside this round's verify (round ahead), drafting the next
            group.predicted, group.drafted = None, True
            return _Half()
        lives = [x for x in group.lives.values() if x.proposal is None]  # the others hold their pre-drafts
        drafting = self._plan(group, lives)
        proposals = self._drafted_here(drafting)
        half = _Half(seqs=len(lives))
        if drafting.calls_drafter:
            pooled = await self._propose(group, lives, drafting, half)
            if pooled is None:  # not drafted as planned: no calibrating on it
                group.predicted = None
            else:
                proposals = [p or d for p, d in zip(proposals, pooled, strict=True)]
        for live, proposal in zip(lives, proposals, strict=True):
            live.proposal = proposal
        group.drafted = True
        return half

    def _plan(self, group: _Group, lives: list[Live]) -> Drafting:
        """Plan the round of `lives` (the group's sequences without a pre-draft), recording its prediction."""
        # The other group's verify runs beside this draft; or, for one sequence drafting round ahead, this
        # round's draft is the exception (a miss) and the next is drafted beside the verify.
        size = len(group.lives)
        overlapped = (len(self.groups) > 1 and all(g.lives for g in self.groups)) or (self.round_ahead and size == 1)
        seqs = [x.seq for x in lives]
        drafting = self.speculation.plan(seqs, size, self.target_waiting, overlapped)
        # A round mixing pre-drafts with these drafts is not the round this plan priced: no calibrating on it.
        group.predicted = drafting.plan.predicted if len(lives) == size else None
        self.ctx.metrics.depth.set(sum(drafting.plan.depths) / max(len(seqs), 1))
        return drafting

    def _drafted_here(self, drafting: Drafting) -> list[WireProposal | None]:
        """The drafts made in the router, no call: prompt lookup's (a call to the draft pool would cost more
        than the lookup), and the trees the target's heads drafted with the last verdicts."""
        proposals = [WireProposal.encode(p) if p is not None else None for p in drafting.found]
        if self.on_target is not None:
            cut = self.on_target.propose(drafting.modelled)
            found = [WireProposal.encode(m) if m.tree.size else None for m in cut]
            proposals = [p or m for p, m in zip(proposals, found, strict=True)]
        return proposals

    async def _propose(
        self, group: _Group, lives: list[Live], drafting: Drafting, half: _Half
    ) -> list[WireProposal] | None:
        """The draft pool's proposals for the planned requests, recorded in `half`; None where the pool was
        not called (backing off, or busy with a pre-draft) or failed (a draft failure never fails a request:
        those sequences decode without speculation)."""
        if not (self.calls.free() and self.calls.pool is not None):
            return None
        modelled = drafting.modelled
        try:
            called = time.perf_counter()
            work = send_work((x, r) for x, r in zip(lives, modelled, strict=True) if r.budget)
            drafted: Drafted = await self.calls.propose(group.index, group.key, modelled, work)
            half.work, half.replica = drafted.work, drafted.replica
            # Priced as the round waits for it, the call included: only drafting rounds pay for the
            # hop to the draft pool.
            waited = time.perf_counter() - called
            trees = [p.tree for p in drafted.proposals]
            self.speculation.drafted([x.seq for x in lives], trees, waited, group.predicted)
            return drafted.proposals
        except Exception as e:
            self.calls.failed(e)
            return None

    # ---- verify and commit -------------------------------------------------------------
    async def _verify(self, group: _Group | None, ahead: bool = False) -> _Half | None:
        if group is None:
            return None
        lives = list(group.lives.values())
        items = [_verify_item(x) for x in lives]
        now = time.time()
        for live in lives:
            live.schedule(now)
        pre = self.ahead.start(group.index, group.key, lives, self.target_waiting) if ahead else None
        verified = await self._verify_call(group, items, borrow=not self.ctx.drafting.calls)
        arrived = time.perf_counter()
        group.drafted = False
        if isinstance(verified, str):
            self._fail(group, verified)
            if pre is not None:  # its drafts are for sequences that just failed
                self.ahead.drop(pre)
            return _Half(seqs=len(lives))
        self.target_waiting = verified.waiting
        trees = [item.proposal.tree for item in items]
        half = _Half(verified.work, len(lives), self._settle(group, lives, trees, verified), verified.replica)
        if pre is not None:  # the verdicts are streamed already: a pre-draft never delays a token
            verdicts = {x.seq.seq_id: v.tokens for x, v in zip(lives, verified.verdicts, strict=True)}
            half.ahead = await self.ahead.settle(
                pre, group.lives, verified.work.seconds, verdicts, self.target_waiting, arrived
            )
            if half.ahead is not None:
                group.drafted = bool(group.lives) and all(x.proposal is not None for x in group.lives.values())
        return half

    def _settle(self, group: _Group, lives: list[Live], trees: list[TokenTree], verified: Verified) -> int:
        """Commit the verdicts and stream them; the tokens committed. A sequence whose row failed on its own at
        the target (`Verdict.error`) ends with that error; the others settle as if it had not been there."""
        verdicts = list(verified.verdicts)
        for live, verdict in zip(lives, verified.verdicts, strict=True):
            if verdict.error is not None:
                self._fail_one(group, live, verdict.error)
        ok = [i for i, v in enumerate(verdicts) if v.error is None]
        lives, trees = [lives[i] for i in ok], [trees[i] for i in ok]
        verified = replace(verified, verdicts=[verdicts[i] for i in ok])
        seqs = [x.seq for x in lives]
        work = verified.work
        news = self.speculation.settle(seqs, trees, verified.verdicts, work.seconds, group.predicted, work.crowded)
        committed = 0
        for live, tree, verdict, new in zip(lives, trees, verified.verdicts, news, strict=True):
            live.proposal = None
            if verdict.drafted is not None and new is not None:  # for the sequence as it now stands
                self.trees[live.seq.seq_id] = NextTree(len(live.seq.tokens), verdict.drafted)
            if new is not None:  # (None: still prefilling, sent again next round)
                committed += self._emit(group, live, tree, len(verdict.accepted), new)
        return committed

    async def _verify_call(self, group: _Group, items: list[WireVerifyItem], borrow: bool) -> Verified | str:
        """The verdicts, or why the verify failed for good (retries spent, or an error retrying cannot fix).
        `borrow`: no draft call runs beside it, so the target may borrow the draft's cores."""
        error: BaseException | None = None
        for attempt in range(self.ctx.config.verify_retries + 1):
            try:
                verified: Verified = await self.ctx.target.call(
                    "verify", self.key, group.key, items, group.release_target, borrow
                )
                group.release_target = []
                return verified
            except Exception as e:  # the replica was lost: retry; Serve routes to a live one, which re-prefills
                logger.warning("lane %s: verify attempt %d failed: %r", self.key, attempt + 1, e)
                error = e
                if not replica_lost(e):
                    break
                await asyncio.sleep(min(0.5 * 2**attempt, 5.0))
        return verify_failure(error)

    def _emit(self, group: _Group, live: Live, tree: TokenTree, n_accepted: int, new: list[int]) -> int:
        """Stream a settled verdict's new tokens to the client; a finished sequence leaves the lane."""
        seq, now = live.seq, time.time()
        self.ctx.metrics.step(tree.depths, n_accepted, len(new), now, live)
        if seq.finish_reason is not None:
            self.ctx.metrics.finished(live, seq.finish_reason, now)
            chunk = {"token_ids": new, "finish_reason": seq.finish_reason, "usage": usage(seq)}
            live.chunks.put_nowait(with_logprobs(chunk, seq, len(new)))
            self._leave(group, live)
        elif new:
            live.chunks.put_nowait(with_logprobs({"token_ids": new, "finish_reason": None}, seq, len(new)))
        return len(new)

    def _leave(self, group: _Group, live: Live) -> None:
        seq_id = live.seq.seq_id
        group.lives.pop(seq_id, None)
        self.trees.pop(seq_id, None)
        self.calls.release[group.index].append(seq_id)
        group.release_target.append(seq_id)

    def _fail(self, group: _Group, message: str) -> None:
        for live in list(group.lives.values()):
            self._fail_one(group, live, message)

    def _fail_one(self, group: _Group, live: Live, message: str) -> None:
        self.ctx.metrics.finished(live, "error", time.time())
        live.chunks.put_nowait({"error": message})
        self._leave(group, live)

    def _release_idle(self) -> None:
        """A group left empty has no next verify to carry its releases: they go now, beside the next round (the
        target replica's KV ledger frees them at once, so it no longer counts finished sequences as waiting)."""
        idle = [g for g in self.groups if not g.lives and (g.release_target or self.calls.release[g.index])]
        if idle:
            task = asyncio.get_running_loop().create_task(self._flush_releases(idle))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)

    async def _flush_releases(self, groups: list[_Group] | None = None) -> None:
        """Tell the workers to forget the sequences `groups` (all: the lane is empty) released, now, instead of
        on a next call that will not come."""
        for group in self.groups if groups is None else groups:
            draft_ids, self.calls.release[group.index] = self.calls.release[group.index], []
            target_ids, group.release_target = group.release_target, []
            for pool, ids in ((self.ctx.draft, draft_ids), (self.ctx.target, target_ids)):
                if pool is not None and ids:
                    try:
                        await pool.call("release", self.key, group.key, ids)
                    except Exception as e:  # soft state: the worker evicts idle groups anyway
                        logger.info("lane %s: release failed (%r)", self.key, e)


def _verify_item(live: Live) -> WireVerifyItem:
    """The verify call's item for a sequence: its proposal, or no draft (`bare_proposal`)."""
    seq = live.seq
    return WireVerifyItem(
        seq.seq_id, tuple(seq.tokens), seq.params, live.proposal or bare_proposal(seq), _kv(seq), len(seq.prompt)
    )


def _kv(seq: Sequence) -> int:
    """KV tokens reserved for the sequence at admission (actors/admission.py): prompt plus max_tokens."""
    return len(seq.prompt) + seq.params.max_tokens
