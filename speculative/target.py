"""The target side of a step: verify each sequence's tree in one batched forward and commit.

The cache holds every committed token but the last (the tree's root). A sequence the verifier has
not seen, or whose cache disagrees with the tokens it is sent (a restart, a rollback, a replica
change), is re-prefilled in the same forward: its missing tokens go in as a chain with the tree
hung after them. A miss costs time, never correctness.

Chunked prefill: one forward carries at most `prefill_chunk` catch-up tokens over all its rows
(the shortest catch-ups first, so a short prompt that comes during a long one's prefill starts at
once). A row whose catch-up does not fit gets what is left of the budget as a plain chain,
committed, and an empty verdict (no tokens: still prefilling); the caller sends it again with the
next round. So a long prompt is prefilled over several rounds, interleaved with the other rows'
verification, and no forward holds attention scores or masks over more than a chunk of new tokens.
Example, budget 4: rows with catch-ups 0, 6, 3 get 0 + tree, 1 (empty verdict), 3 + tree; next
call: 0 + tree, 4 (empty verdict), 0 + tree; then 0 + tree, 1 + tree, 0 + tree. The chunk may
follow the decoding rows' inter-token budget instead (`planning.chunking`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from speculative.drafters.base import Proposal
from speculative.drafters.heads import HeadInput, NextTree, TreeHeads
from speculative.engine.packing import row_offsets
from speculative.engine.runner import ModelRunner, chain_parents
from speculative.planning.chunking import Sizing, grants
from speculative.rules.acceptance import Verdict, follow_choices
from speculative.rules.grammar import GrammarCompiler
from speculative.rules.logprobs import token_logprobs
from speculative.rules.processing import node_context, processed, processes
from speculative.rules.rng import KeyedDraws, Stream
from speculative.rules.sampling import SamplingParams, probs_from_logits
from speculative.rules.verify import argmax_decides, verify_tree
from speculative.rules.walk import Rule, Trees, walk

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Forward:
    """One verify forward's inputs, per runner row, and what the verdicts need of them."""

    tokens: list[list[int]]  # per runner row: catch-up chain + tree (or a prefill chunk alone)
    parents: list[list[int]]
    logits_at: list[list[int]]  # the tree's nodes (none while prefilling)
    offsets: list[int]  # per item: catch-up tokens before its root
    firsts: list[int]  # per item: the position of its row's first column (the tokens its cache holds)
    prefilling: dict[int, int]  # runner row -> catch-up tokens it gets (no tree: still prefilling)


@dataclass(frozen=True)
class VerifyItem:
    seq_id: str
    tokens: tuple[int, ...]  # committed tokens, prompt included; the last is the tree's root
    params: SamplingParams
    proposal: Proposal
    prompt_len: int = 0  # how many of `tokens` are the prompt (output penalties, min_tokens)


class TargetVerifier:
    """Verification of many sequences' trees against one target model."""

    def __init__(
        self,
        runner: ModelRunner,
        prefill_chunk: int | None = None,
        eos_ids: frozenset[int] = frozenset(),
        grammars: GrammarCompiler | None = None,
        heads: TreeHeads | None = None,
        device_round: bool | None = None,
    ) -> None:
        """`prefill_chunk`: most catch-up tokens per forward, over all rows (None: no limit). `eos_ids`:
        the model's end tokens, banned with the stop ids before a request's `min_tokens`. `grammars`:
        the target tokenizer's grammar compiler (structured output); None refuses requests with one.
        `heads`: heads drafting from the target's hidden states (Medusa, EAGLE: `drafters.heads`), given
        those of every kept position after each forward; the tree each drafts for a sequence's next round
        is kept in `drafted` (what `drafters.heads.TreeDrafter` reads in-process) and rides on its verdict.
        `device_round`: every row's acceptance walked where the logits are (`rules.walk`), one read-back of
        ids per round; None: on a GPU (on a CPU the host walk reads fewer numbers for the same work)."""
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1, not {prefill_chunk}")
        self.runner = runner
        self.prefill_chunk = prefill_chunk
        self.eos_ids = eos_ids
        self.grammars = grammars
        self.heads = heads
        self.drafted: dict[str, NextTree] = {}  # per sequence, the heads' tree after its last verdict
        self.last_tokens = 0  # tokens the last forward computed, every row (what its seconds bought)
        self.device_round = runner.device.type == "cuda" if device_round is None else device_round

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def verify(self, items: list[VerifyItem], sizing: Sizing | None = None) -> list[Verdict]:
        """Each item's verdict (empty while its prompt is still prefilling). `sizing`: the forwards' measured costs
        with the other rows' inter-token budget, which size a long prompt's chunk within `[LEAST_CHUNK,
        prefill_chunk]`, and whether no sequence but these waits on the model (`planning.chunking`). None:
        `prefill_chunk` tokens."""
        self.last_tokens = 0
        if not items:
            return []
        for item in items:
            if item.proposal.tree.root != item.tokens[-1]:
                raise ValueError(f"{item.seq_id}: tree root is not the last committed token")
        new = [i.seq_id for i in items if i.seq_id not in self.runner.rows]
        if new:
            self.runner.add_rows(new)
        rows = [self.runner.row(i.seq_id) for i in items]
        self.runner.reserve(max(len(i.tokens) + i.proposal.tree.size for i in items))
        missing = self.runner.sync(rows, [list(i.tokens) for i in items])
        catch_ups, trees = [len(m) - 1 for m in missing], [i.proposal.tree.size + 1 for i in items]
        granted = (
            sizing.grants(catch_ups, trees, self.prefill_chunk)
            if sizing is not None
            else grants(catch_ups, trees, self.prefill_chunk, None, alone=False)
        )
        forward = self._inputs(items, rows, missing, granted)
        self.last_tokens = sum(len(t) for t in forward.tokens)
        # Heads read the hidden state of every kept position: the forward returns every column's, and
        # only the trees' go through the LM head.
        gather = forward.logits_at if self.heads is None else [list(range(len(t))) for t in forward.tokens]
        hidden = self.runner.forward_hidden(forward.tokens, forward.parents, gather)  # [P', H]
        picked = (
            hidden
            if hidden is None or self.heads is None
            else hidden[_subset(gather, forward.logits_at).to(hidden.device)]
        )
        # [P, V] on the model's device; none while every row is still prefilling
        logits = self.runner.logits(picked) if picked is not None else torch.empty(0, self.vocab_size)
        verdicts, keep = self._verdicts(items, rows, forward, logits)
        self.runner.commit(keep)
        if self.heads is not None and hidden is not None:
            verdicts = self._draft(items, rows, forward, verdicts, keep, hidden)
        return verdicts

    def _draft(
        self,
        items: list[VerifyItem],
        rows: list[int],
        forward: _Forward,
        verdicts: list[Verdict],
        keep: list[list[int]],
        hidden: torch.Tensor,  # [P', H] every column's last hidden state, rows packed
    ) -> list[Verdict]:
        """Hand the heads each row's kept hidden states; the trees they draft go in `drafted` and ride on
        the verdicts (a row still prefilling drafts none)."""
        assert self.heads is not None
        starts = row_offsets([len(t) for t in forward.tokens])  # the heads' forward gathers every column
        inputs = []
        for item, row, first, verdict in zip(items, rows, forward.firsts, verdicts, strict=True):
            at = torch.tensor([starts[row] + c for c in keep[row]], dtype=torch.long, device=hidden.device)
            tokens = (*item.tokens, *verdict.tokens)
            inputs.append(HeadInput(item.seq_id, tokens, first, hidden[at], bool(verdict.tokens)))
        out = list(verdicts)
        for k, (given, tree) in enumerate(zip(inputs, self.heads.advance(inputs), strict=True)):
            if tree is not None:
                self.drafted[given.seq_id] = NextTree(len(given.tokens), tree)
                out[k] = replace(verdicts[k], drafted=tree)
        return out

    def _inputs(
        self, items: list[VerifyItem], rows: list[int], missing: list[list[int]], granted: list[int]
    ) -> _Forward:
        """Each row's catch-up chain with its tree hung after it, or the part of its catch-up `granted`."""
        width = len(self.runner.rows)
        forward = _Forward(
            tokens=[[] for _ in range(width)],
            parents=[[] for _ in range(width)],
            logits_at=[[] for _ in range(width)],
            offsets=[],
            firsts=[],
            prefilling={},
        )
        for item, row, miss, grant in zip(items, rows, missing, granted, strict=True):
            off = len(miss) - 1  # catch-up tokens before the root
            forward.firsts.append(len(item.tokens) - len(miss))
            if off > grant:
                forward.prefilling[row] = grant
                forward.tokens[row], forward.parents[row] = miss[:grant], chain_parents(grant)
                forward.offsets.append(0)
                continue
            tree = item.proposal.tree
            forward.tokens[row] = miss[:-1] + list(tree.all_tokens)
            forward.parents[row] = chain_parents(off) + [p + off if p >= 0 else off - 1 for p in tree.runner_parents()]
            forward.logits_at[row] = list(range(off, off + tree.size + 1))
            forward.offsets.append(off)
        return forward

    def _verdicts(
        self,
        items: list[VerifyItem],
        rows: list[int],
        forward: _Forward,
        logits: torch.Tensor,  # [P, V]
    ) -> tuple[list[Verdict], list[list[int]]]:
        """Each item's verdict and each runner row's kept columns.

        Greedy rows without penalties need only each node's argmax: taken where the logits are, so
        only [P] ids cross to the CPU; the others get float32 distributions there, in one transfer."""
        starts = row_offsets([len(a) for a in forward.logits_at])  # each runner row's first logits row
        if self.device_round:
            firsts = {k: starts[row] for k, row in enumerate(rows) if row not in forward.prefilling}
            return self._kept(rows, forward, self._walked(items, firsts, logits))
        argmax_only = [argmax_decides(item.params) for item in items]
        peaks, indices = logits.max(-1)  # [P] each: the argmax (its first maximum), and NaN where a row holds one
        best, peak = indices.tolist(), peaks.tolist()
        sizes = {row: item.proposal.tree.size + 1 for item, row in zip(items, rows, strict=True)}  # root included
        full = [row for row, a in zip(rows, argmax_only, strict=True) if not a and row not in forward.prefilling]
        host: dict[int, torch.Tensor] = {}  # row -> [n+1, V] float32 on the CPU
        if full:
            index = torch.cat([torch.arange(starts[r], starts[r] + sizes[r]) for r in full]).to(logits.device)
            moved = logits[index].float().cpu().split([sizes[r] for r in full])
            host = dict(zip(full, moved, strict=True))
        found: dict[int, Verdict] = {}
        for k, (item, row, a) in enumerate(zip(items, rows, argmax_only, strict=True)):
            if row in forward.prefilling:
                continue
            try:
                if not all(v < INF for v in peak[starts[row] : starts[row] + sizes[row]]):
                    raise NotFinite()
                if a:
                    verdict = follow_choices(item.proposal.tree, best[starts[row] : starts[row] + sizes[row]])
                else:
                    seq = (item.seq_id, item.tokens, item.prompt_len)
                    context = node_context(*seq, item.params, self.eos_ids, self.grammars)
                    verdict = verify_tree(item.proposal, host[row], context, item.params)
                found[k] = _with_logprobs(verdict, item, starts[row], logits)
            except Exception as e:  # this row's own failure: it alone ends, its forward's other rows go on
                found[k] = failed(item, e)
        return self._kept(rows, forward, found)

    def _kept(
        self, rows: list[int], forward: _Forward, found: dict[int, Verdict]
    ) -> tuple[list[Verdict], list[list[int]]]:
        """Each item's verdict (an empty one while prefilling) and each runner row's kept columns."""
        verdicts: list[Verdict] = []
        keep: list[list[int]] = [[] for _ in self.runner.rows]
        for k, (row, off) in enumerate(zip(rows, forward.offsets, strict=True)):
            if row in forward.prefilling:
                verdicts.append(Verdict((), ()))
                keep[row] = list(range(forward.prefilling[row]))
                continue
            verdicts.append(found[k])
            kept = [] if found[k].error is not None else [off + node for node in found[k].path]
            keep[row] = list(range(off)) + kept  # a failed row keeps its catch-up, not its tree
        return verdicts, keep

    def _walked(self, items: list[VerifyItem], firsts: dict[int, int], logits: torch.Tensor) -> dict[int, Verdict]:
        """The verdicts of the items in `firsts` (item index -> its root's row in `logits` [P, V]), walked on the
        logits' device (`rules.walk`): the rows' transforms, argmaxes and distributions stay there and one
        [R, D + 2] tensor of ids is read back. (A grammar's dead-row check and logprobs read back more.)"""
        walking = list(firsts)
        found: dict[int, Verdict] = {}
        if walking:
            trees = [items[k].proposal.tree for k in walking]
            shape = Trees.of(trees, logits.device)
            nodes, fan = shape.children.shape[1:]
            best, probs, draft, rules, draws = [], [], [], [], []
            for k in walking:
                item = items[k]
                tree = item.proposal.tree
                scores = logits[firsts[k] : firsts[k] + tree.size + 1]  # [n+1, V]
                if processes(item.params):
                    try:
                        seq = (item.seq_id, item.tokens, item.prompt_len)
                        context = node_context(*seq, item.params, self.eos_ids, self.grammars)
                        paths = [tree.path_tokens(node) for node in range(tree.size + 1)]
                        scores = processed(scores.float(), context, paths, item.params)
                    except Exception as e:  # this row's own failure: walked as it is, then replaced by the error
                        found[k] = failed(item, e)
                pad = (0, 0, 0, nodes - tree.size - 1)
                best.append(F.pad(scores.argmax(-1), pad[2:]))
                sampled = not item.params.greedy
                probs.append(F.pad(probs_from_logits(scores, item.params), pad) if sampled else None)
                q = item.proposal.draft_probs if sampled else None
                draft.append(None if q is None else F.pad(q.to(logits.device, torch.float32), pad))
                rules.append(Rule.GREEDY if not sampled else Rule.SAMPLE if q is None else Rule.REJECT)
                keyed, base = KeyedDraws(item.params.seed, Stream.TARGET), len(item.tokens)
                draws.append([[keyed(base + d, j) for j in range(fan + 1)] for d in range(shape.depth + 1)])
            p = _stacked(probs, nodes, logits)
            rule = torch.tensor(rules, dtype=torch.long, device=logits.device)
            walked = walk(
                shape,
                rule,
                torch.stack(best),
                p,
                _stacked(draft, nodes, logits),
                torch.tensor(draws, dtype=torch.float64, device=logits.device),
            )
            # a row whose logits are not finite, or a sampled row whose distributions have no mass (every token
            # filtered), fails alone: their flags ride on the same read-back
            own = [[firsts[k] + min(j, t.size) for j in range(nodes)] for k, t in zip(walking, trees, strict=True)]
            rows = torch.tensor(own, dtype=torch.long, device=logits.device)  # [R, N] each item's logits rows
            finite = (logits.amax(-1) < INF)[rows].all(-1).long()  # [R]: one gather, not a launch per item
            mass = torch.ones_like(finite) if p is None else _has_mass(p, shape.tokens, rule)
            flags = torch.stack([finite, mass.to(finite.dtype)], 1)  # [R, 2]
            for k, tree, row in zip(walking, trees, torch.cat([walked, flags], 1).tolist(), strict=True):
                ids = row[:-2]  # [D + 2]: accepted nodes, then the emitted token; the round's one read-back
                if not row[-2]:
                    found[k] = failed(items[k], NotFinite())
                elif k not in found and not row[-1]:
                    found[k] = failed(items[k], ValueError("cannot sample from a distribution with no mass"))
                if k in found:  # failed above
                    continue
                accepted = tuple(n for n in ids[:-1] if n >= 0)
                verdict = Verdict(accepted, (*[tree.token(n) for n in accepted], ids[-1]))
                found[k] = _with_logprobs(verdict, items[k], firsts[k], logits)
        return found

    def release(self, seq_ids: list[str]) -> None:
        for s in seq_ids:
            self.drafted.pop(s, None)
        if self.heads is not None:
            self.heads.release(seq_ids)
        if self.grammars is not None:
            self.grammars.release(seq_ids)
        known = [s for s in seq_ids if s in self.runner.rows]
        if known:
            self.runner.remove_rows(known)

    def cached_sequences(self) -> int:
        """Sequences whose KV this verifier holds (rows of its runner)."""
        return len(self.runner.rows)


def _subset(gather: list[list[int]], wanted: list[list[int]]) -> torch.Tensor:
    """Indices into rows packed by `gather` (each row's every column) of each row's `wanted` columns."""
    starts = row_offsets([len(g) for g in gather])
    return torch.tensor([starts[row] + c for row, cols in enumerate(wanted) for c in cols], dtype=torch.long)


def _has_mass(probs: torch.Tensor, tokens: torch.Tensor, rules: torch.Tensor) -> torch.Tensor:  # -> [R] int64
    """1 where a sampled row's every node (pads aside) has a distribution to sample from, and on greedy rows.
    probs [R, N, V]; tokens [R, N] (pads -1); rules [R] (`walk.Rule`)."""
    mass = probs.sum(-1)  # [R, N]
    node_ok = torch.isfinite(mass) & (mass > 0.0) | (tokens < 0)  # [R, N]
    return (node_ok.all(-1) | (rules == Rule.GREEDY)).long()


def _stacked(
    rows: list[torch.Tensor | None], nodes: int, like: torch.Tensor
) -> torch.Tensor | None:  # [R, N, V] float32, zeros where a row has none
    if all(r is None for r in rows):
        return None
    empty = like.new_zeros(nodes, like.shape[-1], dtype=torch.float32)
    return torch.stack([empty if r is None else r.float() for r in rows])


def _with_logprobs(verdict: Verdict, item: VerifyItem, first: int, logits: torch.Tensor) -> Verdict:
    """The verdict with its tokens' logprobs where the request asks (`first`: its root's logits row)."""
    if item.params.logprobs is None:
        return verdict
    emitting = torch.tensor([first + node for node in verdict.path], device=logits.device)
    return replace(verdict, logprobs=token_logprobs(logits[emitting], verdict.tokens, item.params.logprobs))


INF = float("inf")


class NotFinite(FloatingPointError):
    """A row's logits hold NaN or +inf: the model's arithmetic failed on this sequence's tokens."""

    def __init__(self) -> None:
        super().__init__("the target's logits for this request are NaN or infinite at its tokens")


def failed(item: VerifyItem, error: Exception) -> Verdict:
    """The verdict of a row that failed on its own (its grammar, its parameters): no tokens, the cause in words."""
    logger.warning("%s failed at the target: %r", item.seq_id, error)
    return Verdict((), (), error=f"this request failed at the target: {type(error).__name__}: {error}")
