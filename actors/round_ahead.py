"""Round ahead in a lane (`speculative/planning/ahead.py`): the next round's drafts, made beside a verify.

While a group is verified, the draft pool pre-drafts that group's next round from the continuation
it expects, for a group of one sequence (at one stream nothing else would overlap). A sequence alone
in its group starts beside its prefill (`router.catch_up_beside_prefill`): the draft model catches
up on the prompt there, drafting nothing (a draft beside the prefill is for a first token not yet
known), so the round after the first token drafts at once. Otherwise (or where the pool was busy
beside the prefill) the sequence's second round verifies no draft while the draft model catches up
and pre-drafts the third round beside it, under its guesses of the verify's token. A prompt over
`router.ahead_prefill_tokens`, and a sequence beside others, is left to the depth controller, which
prices its catch-up (with ping-pong, in the draft half beside the other group's verify). When the
verdict matches, the next verify starts at once with that draft (or with prompt lookup's quote of
the context, where the quote runs deeper); when not, the sequence is drafted again at the next
round's start.

A pre-draft drafts until its verdict is expected at the router: the verify's predicted seconds plus
a learned offset (the calls' hops and the prediction's bias, `StepCosts.ahead_deadline`), or, where the
planner chose a depth whose draft takes longer (priced overlapped: the round costs the longer of the
two), until that depth's predicted seconds: where a draft forward costs a large share of the verify
(a 0.5B draft of a 1.5B target on its own core), drafts cut to the verify's length would stay shallow
round after round. The round waits for a pre-draft at most as long as its verify took or its deadline
(a catch-up: until it answers, within its call's deadline); a later one is dropped, and the pool is not
called again until it has answered.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import NamedTuple

from actors.config import RouterConfig
from actors.draft_calls import DraftCalls, send_work
from actors.metrics import RouterMetrics
from actors.records import Live, bare_proposal
from actors.wire import Drafted, WireProposal, Work
from speculative.drafters.base import DraftRequest, Proposal
from speculative.planning.ahead import ahead_request, assumed_path, take_ahead
from speculative.planning.round import Speculation
from speculative.planning.rows import QUOTE_RUN


class Ahead(NamedTuple):
    """One sequence of a pre-draft."""

    live: Live
    path: list[int]  # the draft tokens the pre-draft assumes accepted
    depth: int  # how deep it pre-drafts (0: a catch-up, drafting nothing)


@dataclass
class PreDraft:
    """A pre-draft in flight: the next round's drafts for some of a group's sequences."""

    group: int
    task: asyncio.Task[Drafted]
    sequences: list[Ahead]  # in the order of the call's requests
    released: list[str]  # sequence ids the call tells the worker to forget (restored if it fails)
    catching_up: bool = False  # its sequence's prompt is caught up on (`RoundAhead.catches_up`): awaited whole
    predicted: float | None = None  # the verify's predicted seconds its deadline was sized from (None: no deadline)
    deadline: float = 0.0  # its drafting's deadline, seconds from its start (0: none)
    answered: float | None = None  # `time.perf_counter()` when the pool answered

    def on_answer(self, _: asyncio.Task[Drafted]) -> None:
        self.answered = time.perf_counter()

    @property
    def drafting(self) -> int:
        """The sequences it drafts for (a catch-up is not a pre-draft that can hit or miss)."""
        return sum(1 for a in self.sequences if a.depth)


@dataclass(frozen=True)
class Settled:
    """How a pre-draft ended within its round."""

    work: Work
    tried: int  # the sequences it drafted for that have a next round to hit or miss (not those the verdict ended)
    hits: int
    unverified: int
    cut_hits: int = 0  # of the hits, those whose verdict cut the assumed path (an alternative's branch)


class RoundAhead:
    """A lane's pre-drafts: which sequences pre-draft and how deep, sending them, taking the hits."""

    def __init__(self, calls: DraftCalls, config: RouterConfig, metrics: RouterMetrics, speculation: Speculation):
        self.calls, self.config, self.metrics, self.speculation = calls, config, metrics, speculation

    def catches_up(self, live: Live) -> bool:
        """Whether this sequence, alone in its group, verifies its round with no draft while the draft model
        catches up on its prompt beside that verify: in its prefill (catching up only, where
        `catch_up_beside_prefill`), or past it never drafted (catching up, then pre-drafting the next round);
        its prompt within `ahead_prefill_tokens`, and speculating."""
        seq = live.seq
        return (
            (self.config.catch_up_beside_prefill if not seq.stats.steps else not live.draft_seen)
            and len(seq.tokens) <= self.config.ahead_prefill_tokens
            and seq.params.max_draft_tokens != 0
            and seq.params.max_tokens - len(seq.output) > 2  # a drafting round after this one
            and self._deterministic(live)
            and self.calls.pool is not None
            and self.calls.free()
        )

    def _deterministic(self, live: Live) -> bool:
        """The sequence's tokens do not depend on the draft: greedy, or deterministic drafts."""
        return live.seq.params.greedy or not self.config.drafts_sampled

    def depth(self, live: Live, group_size: int, target_waiting: int, catching_up: bool = False) -> int | None:
        """How deep to pre-draft this sequence's next round (None: not at all).

        A sequence drafting alone in its group drafts what the planner chooses for its next round, priced
        as overlapped (a hit hides the draft behind the verify), and so does one `catching_up` (`catches_up`;
        0 deep where its depth is cut to nothing, and not at all where the planner drafts nothing); others are
        planned at their round's start. Only sequences whose tokens do not depend on the draft (greedy, deterministic
        drafts) pre-draft, and not those the router drafts by lookup itself (free, at the round's start).
        """
        seq, speculation = live.seq, self.speculation
        tree = live.proposal.tree if live.proposal is not None else None
        catch_up = 0 if catching_up else None  # the depth of a call that only catches up
        drafted = tree is not None and tree.size
        if not (catching_up or (group_size == 1 and drafted and self._deterministic(live))):
            return None
        if catching_up and not seq.stats.steps:
            return catch_up  # beside a prefill: catching up only (`catches_up`)
        # priced as drafted: beside the verify, one forward deeper (the guess of the bonus comes first)
        plan = speculation.depths([seq], 1, target_waiting, overlapped=True, extra_levels=1)
        (row,) = plan.rows
        if speculation.lookup is not None and row.run:  # a quote: drafted by lookup at the round's start
            return catch_up
        depth = row.depth
        path = len(assumed_path(tree)) if tree is not None else 0
        own = seq.params.max_draft_tokens if seq.params.max_draft_tokens is not None else depth
        # A hit of the guess follows a round that commits path + bonus, and the next round adds at least one
        # token; with alternatives, a hit may follow a cut as early as the first draft (one token committed),
        # which leaves the next round room for more (near max_tokens, the round that would be redrafted).
        cut = 0 if self.config.ahead_alternatives else path
        depth = min(depth, own, seq.params.max_tokens - len(seq.output) - cut - 2)
        if depth > 0:
            return depth
        # Where the planner drafts nothing next (speculation does not pay at these costs), no catch-up either: it
        # would crowd this verify for drafts not wanted. A round that drafts later pays its catch-up, as priced.
        return catch_up if row.depth else None

    def start(self, g: int, cache_key: str, lives: list[Live], target_waiting: int) -> PreDraft | None:
        """Send the pre-drafts of this group's next round, beside the verify about to start."""
        if self.calls.pool is None or not self.calls.free():
            return None
        catching_up = len(lives) == 1 and self.catches_up(lives[0])
        n = len(lives)
        picked = [(x, d) for x in lives if (d := self.depth(x, n, target_waiting, catching_up)) is not None]
        if not picked:
            return None
        trees = {x.seq.seq_id: (x.proposal or bare_proposal(x.seq)).tree for x in lives}  # as verified
        # Hidden behind the verify about to start: no level that would end after its verdict is back (the
        # round would wait); a catch-up drafts its whole depth, as the round's start would have after catching
        # up in its place.
        seqs, costs = [x.seq for x in lives], self.speculation.costs
        predicted = None if catching_up else self.speculation.verify_seconds(seqs, list(trees.values()))
        deadline = None if predicted is None or costs is None else costs.ahead_deadline(predicted)
        if deadline is not None and costs is not None:  # the plan's depth, where its draft outlasts the verify
            deadline = max(deadline, costs.ahead_draft_seconds(max(d for _, d in picked)))
        requests, sequences = [], []
        for live, depth in picked:
            seq, tree = live.seq, trees[live.seq.seq_id]
            # a catch-up (0 deep) is a plain draft call, its guess unused; with no spine (beside a verify of no
            # draft) the alternatives are more guesses of the bonus (`_propose_ahead`)
            alternatives = self.config.ahead_alternatives if depth else 0
            base = DraftRequest(seq.seq_id, tuple(seq.tokens), depth, seq.params, len(seq.prompt))
            request = ahead_request(base, tree, alternatives, deadline if depth else None)
            requests.append(request)
            sequences.append(Ahead(live, assumed_path(tree), depth))
            # What the draft model will have seen: the load planner's catch-up accounting (`catch_up`).
            seq.stats.record_model_draft(len(request.tokens), 0)
        work = send_work(zip([x for x, _ in picked], requests, strict=True))
        task, released = self.calls.send(g, cache_key, requests, work)
        pre = PreDraft(g, task, sequences, released, catching_up, predicted, deadline or 0.0)
        task.add_done_callback(pre.on_answer)
        return pre

    def _quoted_deeper(self, live: Live, taken: Proposal, target_waiting: int) -> bool:
        """Whether the next round would rather verify prompt lookup's quote of the context than this hit: the
        quote (free, and landing far more often than a guess) runs deeper than the pre-draft's proposal,
        as at the start of a passage the output copies, which the pre-draft's plan could not yet see."""
        if self.speculation.lookup is None:
            return False
        (row,) = self.speculation.depths([live.seq], 1, target_waiting, overlapped=True).rows
        return row.run >= QUOTE_RUN and row.depth > max(taken.tree.depths)

    def _learn_deadline(self, pre: PreDraft, work: Work, arrived: float | None) -> None:
        """What the pre-draft's deadline should have been: its seconds, less how late it answered after the
        verdict (learned from pre-drafts with a deadline: beside a verify of drafts, the steady rounds it is for)."""
        costs, predicted, answered = self.speculation.costs, pre.predicted, pre.answered
        if costs is None or predicted is None or answered is None or arrived is None:
            return
        costs.observe_ahead(predicted, work.seconds - (answered - arrived))

    def drop(self, pre: PreDraft) -> None:
        """Leave a pre-draft to finish unused; the pool is not called until it has answered."""
        self.calls.leave_running(pre.task)

    async def settle(
        self,
        pre: PreDraft,
        group: dict[str, Live],
        verify_s: float,
        committed: dict[str, tuple[int, ...]],
        target_waiting: int = 0,
        arrived: float | None = None,
    ) -> Settled | None:
        """Take the pre-drafts that the verdicts (`committed`: each sequence's verdict tokens) matched, as
        the proposals of `group`'s (the pre-draft's group) next round; None: nothing came in time. A hit
        yields to prompt lookup's quote of the context where the quote runs deeper (`_quoted_deeper`).

        Waits at most `verify_s` (the verify's own duration) or the pre-draft's deadline, the longer, for the
        pre-draft; a later one is left to
        finish, its drafts dropped (the pool is not called again until it answers). One catching up on a
        prompt is awaited whole: the next round would otherwise wait for that catch-up and a draft. When every sequence
        of it is still prefilling (a chunk of a long prompt), nothing of it can be taken: the next chunk's
        round starts at once, and the draft model's catch-up goes on beside it."""
        if not any(committed.get(a.live.seq.seq_id) for a in pre.sequences):
            self.drop(pre)
            self.metrics.ahead(pre.drafting, 0, "settled")  # misses: drafted for a prompt not yet done
            return None
        # (a catch-up's wait ends within its call's own deadline, sized to its work: `DraftCalls.send`)
        done, _ = await asyncio.wait({pre.task}, timeout=None if pre.catching_up else max(verify_s, pre.deadline))
        if not done:
            self.drop(pre)
            self.metrics.ahead(pre.drafting, 0, "late")
            return None
        try:
            drafted = pre.task.result()
        except Exception as e:
            self.calls.release[pre.group] += pre.released
            self.calls.failed(e)
            return None
        self._learn_deadline(pre, drafted.work, arrived)
        hits, cut_hits, unverified, ended = 0, 0, 0, 0
        for (live, path, depth), wire in zip(pre.sequences, drafted.proposals, strict=True):
            verdict = committed.get(live.seq.seq_id)  # () while still prefilling
            alive = bool(verdict) and live.seq.seq_id in group and live.seq.finish_reason is None
            ended += bool(depth and verdict and live.seq.finish_reason is not None)  # no next round: no hit or miss
            taken = take_ahead(wire.decode(), verdict) if alive and verdict else None
            # the spine's nodes are round N's own drafts, verified there
            unverified += wire.tree.size - len(path) - (taken.tree.size if taken is not None else 0)
            if taken is not None:
                hits, cut_hits = hits + 1, cut_hits + (len(verdict or ()) <= len(path))
                if self._quoted_deeper(live, taken, target_waiting):
                    unverified += taken.tree.size  # the round plans the quote in its place
                else:
                    live.proposal = WireProposal.encode(taken)
                    live.seq.stats.record_drafter(0)  # its next verdict is the draft model's, not a lookup's
        self.metrics.ahead(pre.drafting - ended, hits, "settled", unverified)
        return Settled(drafted.work, pre.drafting - ended, hits, unverified, cut_hits)
