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
from dataclasses import dataclass, replace

from actors.config import RouterConfig
from actors.draft_calls import DraftCalls, draft_work
from actors.metrics import RouterMetrics
from actors.pools import Pool, replica_lost, verify_failure
from actors.records import Live, StepRecord, bare_proposal, usage, with_logprobs
from actors.round_ahead import RoundAhead, Settled
from actors.wire import Drafted, Verified, WireProposal, WireVerifyItem, Work
from speculative.drafters.heads import NextTree, TreeDrafter
from speculative.drafters.lookup import PromptLookupDrafter
from speculative.planning.costs import Planned, StepCosts
from speculative.planning.round import Speculation
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
    """One lane's sequences in their groups, and the loop that drafts, verifies and commits them."""

    def __init__(self, key: str, ctx: LaneContext, on_done: Callable[[Lane], None]) -> None:
        self.key, self.ctx, self._on_done = key, ctx, on_done
        # Nothing to overlap without a draft pool to call: none, or prompt lookup alone (drafted here).
        pool_drafts = ctx.draft is not None and (ctx.config.lookup_ngrams is None or ctx.config.lookup_quotes)
        n = 2 if ctx.config.pipelining and pool_drafts else 1
        self.groups: list[dict[str, Live]] = [{} for _ in range(n)]
        self.drafted = [False] * n  # group holds proposals not yet verified
        self.calls = DraftCalls(ctx.draft, key, n, ctx.config)
        # per group, the planned round's prediction (`Plan.predicted`; None: not a priced round)
        self.predicted: list[Planned | None] = [None] * n
        self.release_target: list[list[str]] = [[] for _ in range(n)]
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
            draft = await self._draft(g, ahead=self.round_ahead) if not self.drafted[g] else None
            verify = await self._verify(g, ahead=self.round_ahead)
        else:
            vg = next((g for g in (0, 1) if self.drafted[g] and self.groups[g]), None)
            dg = next((g for g in (0, 1) if not self.drafted[g] and self.groups[g] and g != vg), None)
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
        for g, group in enumerate(self.groups):
            for live in [x for x in group.values() if x.cancelled]:
                self._leave(g, live)

    # ---- draft -------------------------------------------------------------------------
    async def _draft(self, g: int | None, ahead: bool = False) -> _Half | None:
        if g is None:
            return None
        group = list(self.groups[g].values())
        if ahead and len(group) == 1 and self.ahead.catches_up(group[0]):
            # the draft model catches up beside this round's verify (round ahead), drafting the next
            self.predicted[g], self.drafted[g] = None, True
            return _Half()
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
        # Prompt lookup drafts here, in the router: a call to the draft pool would cost more than the lookup.
        proposals = [WireProposal.encode(p) if p is not None else None for p in drafting.found]
        if self.on_target is not None:  # the trees the target's heads drafted, here: no call
            cut = self.on_target.propose(modelled)
            found = [WireProposal.encode(m) if m.tree.size else None for m in cut]
            proposals = [p or m for p, m in zip(proposals, found, strict=True)]
        half = _Half(seqs=len(lives))
        called_pool = False
        if self.calls.free() and self.calls.pool is not None and drafting.calls_drafter:
            try:
                called = time.perf_counter()
                work = sum(draft_work(x, r) for x, r in zip(lives, modelled, strict=True) if r.budget)
                drafted: Drafted = await self.calls.propose(g, self.cache_key(g), modelled, work)
                half.work, half.replica, called_pool = drafted.work, drafted.replica, True
                # Priced as the round waits for it, the call included: only drafting rounds pay for the
                # hop to the draft pool.
                waited = time.perf_counter() - called
                self.speculation.drafted(seqs, [p.tree for p in drafted.proposals], waited, self.predicted[g])
                proposals = [p or d for p, d in zip(proposals, drafted.proposals, strict=True)]
            except Exception as e:  # a draft failure never fails a request: decode without speculation
                self.calls.failed(e)
        if drafting.calls_drafter and not called_pool:  # not drafted as planned: no calibrating on it
            self.predicted[g] = None
        for live, proposal in zip(lives, proposals, strict=True):
            live.proposal = proposal
        self.drafted[g] = True
        return half

    # ---- verify and commit -------------------------------------------------------------
    async def _verify(self, g: int | None, ahead: bool = False) -> _Half | None:
        if g is None:
            return None
        lives = list(self.groups[g].values())
        items = [
            WireVerifyItem(
                x.seq.seq_id,
                tuple(x.seq.tokens),
                x.seq.params,
                x.proposal or bare_proposal(x.seq),
                _kv(x.seq),
                len(x.seq.prompt),
            )
            for x in lives
        ]
        pre = self.ahead.start(g, self.cache_key(g), lives, self.target_waiting) if ahead else None
        verified = await self._verify_call(g, items)
        arrived = time.perf_counter()
        self.drafted[g] = False
        if isinstance(verified, str):
            self._fail(g, verified)
            if pre is not None:  # its drafts are for sequences that just failed
                self.ahead.drop(pre)
            return _Half(seqs=len(lives))
        self.target_waiting = verified.waiting
        seqs, trees = [x.seq for x in lives], [item.proposal.tree for item in items]
        news = self.speculation.settle(seqs, trees, verified.verdicts, verified.work.seconds, self.predicted[g])
        committed = 0
        for live, tree, verdict, new in zip(lives, trees, verified.verdicts, news, strict=True):
            live.proposal = None
            if verdict.drafted is not None and new is not None:  # for the sequence as it now stands
                self.trees[live.seq.seq_id] = NextTree(len(live.seq.tokens), verdict.drafted)
            if new is not None:  # (None: still prefilling, sent again next round)
                committed += self._emit(g, live, tree, len(verdict.accepted), new)
        half = _Half(verified.work, len(lives), committed, verified.replica)
        if pre is not None:  # the verdicts are streamed already: a pre-draft never delays a token
            verdicts = {x.seq.seq_id: v.tokens for x, v in zip(lives, verified.verdicts, strict=True)}
            group = self.groups[g]
            half.ahead = await self.ahead.settle(
                pre, group, verified.work.seconds, verdicts, self.target_waiting, arrived
            )
            if half.ahead is not None:
                self.drafted[g] = bool(group) and all(x.proposal is not None for x in group.values())
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
            chunk = {"token_ids": new, "finish_reason": seq.finish_reason, "usage": usage(seq)}
            live.chunks.put_nowait(with_logprobs(chunk, seq, len(new)))
            self._leave(g, live)
        elif new:
            live.chunks.put_nowait(with_logprobs({"token_ids": new, "finish_reason": None}, seq, len(new)))
        return len(new)

    def _leave(self, g: int, live: Live) -> None:
        seq_id = live.seq.seq_id
        self.groups[g].pop(seq_id, None)
        self.trees.pop(seq_id, None)
        self.calls.release[g].append(seq_id)
        self.release_target[g].append(seq_id)

    def _fail(self, g: int, message: str) -> None:
        for live in list(self.groups[g].values()):
            self.ctx.metrics.finished("error", 0.0, 0, 0.0)
            live.chunks.put_nowait({"error": message})
            self._leave(g, live)

    async def _flush_releases(self) -> None:
        """The lane is empty: tell the workers now instead of on a next call that will not come."""
        for g in range(len(self.groups)):
            for pool, pending in ((self.ctx.draft, self.calls.release), (self.ctx.target, self.release_target)):
                ids, pending[g] = pending[g], []
                if pool is not None and ids:
                    try:
                        await pool.call("release", self.key, self.cache_key(g), ids)
                    except Exception as e:  # soft state: the worker evicts idle groups anyway
                        logger.info("lane %s: release failed (%r)", self.key, e)


def _kv(seq: Sequence) -> int:
    """KV tokens reserved for the sequence at admission (actors/admission.py): prompt plus max_tokens."""
    return len(seq.prompt) + seq.params.max_tokens
