"""A draft model proposing a chain, or a tree shaped by its own confidence (EAGLE-2).

One batched draft forward per depth; the first also catches the draft's cache up to the committed
tokens. After proposing, the drafter keeps the KV of its most likely path tentatively committed;
the next request's `sync` cuts it back to what the target accepted, so accepted draft tokens are
not computed twice.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch

from speculative.drafters.base import DraftRequest, Proposal, empty_proposal
from speculative.engine.packing import row_offsets
from speculative.engine.runner import ModelRunner, chain_parents
from speculative.rules.grammar import GrammarCompiler
from speculative.rules.processing import node_context, processed, processes
from speculative.rules.rng import Stream, sample, uniform
from speculative.rules.sampling import probs_from_logits
from speculative.rules.tree import TokenTree


@dataclass
class _Node:
    token: int
    parent: int  # index in the row's node list; -1 for the root (node 0)
    depth: int  # root 0
    score: float  # log-probability of the path under the draft
    column: int = -1  # speculative column in the draft runner once forwarded
    probs: torch.Tensor | None = None  # [V] q at this node once expanded (sampled drafts)


@dataclass(frozen=True)
class DraftShape:
    """The shape of a draft model's proposals."""

    tree_width: int = 1  # children per expanded node, and nodes expanded per depth; 1 drafts a chain
    tree_nodes: int = 64  # most draft nodes in one tree
    sampled: bool = True  # under sampling: children drawn from q (rejection rule), not top-k
    catch_up_chunk: int = 512  # most tokens a row catches up on per forward

    def __post_init__(self) -> None:
        if self.tree_width < 1 or self.tree_nodes < 1 or self.catch_up_chunk < 1:
            raise ValueError("tree_width, tree_nodes and catch_up_chunk must be >= 1")


class DraftModelDrafter:
    """Chain (`tree_width=1`) or confidence-shaped tree drafts from a smaller causal LM."""

    def __init__(
        self,
        runner: ModelRunner,
        target_vocab: int,
        shape: DraftShape = DraftShape(),
        eos_ids: frozenset[int] = frozenset(),
        grammars: GrammarCompiler | None = None,
    ) -> None:
        """`shape.catch_up_chunk`: a long prompt catches up over several forwards, so no forward holds
        attention over more new tokens than that. `eos_ids`: end tokens, banned before a request's
        `min_tokens` as the target bans them. `grammars`: the draft tokenizer's grammar compiler, masking q
        as the target's grammar masks p (better acceptance); None drafts unmasked."""
        self.runner = runner
        self.vocab = min(target_vocab, runner.vocab_size)  # ids both models can emit
        self.target_vocab = target_vocab
        self.width = shape.tree_width
        self.max_nodes = shape.tree_nodes
        self.sampled = shape.sampled
        self.catch_up_chunk = shape.catch_up_chunk
        self.eos_ids = eos_ids
        self.grammars = grammars

    def release(self, seq_ids: list[str]) -> None:
        if self.grammars is not None:
            self.grammars.release(seq_ids)
        known = [s for s in seq_ids if s in self.runner.rows]
        if known:
            self.runner.remove_rows(known)

    def cached_sequences(self) -> int:
        return len(self.runner.rows)

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        ahead = [r.budget > 0 and r.pre_draft for r in requests]  # pre-drafts: their own forwards
        drafted = iter(self._propose([r for r, a in zip(requests, ahead, strict=True) if not a]))
        return [self._propose_ahead(r) if a else next(drafted) for r, a in zip(requests, ahead, strict=True)]

    def _propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        active = [r for r in requests if r.budget > 0]
        if not active:
            return [empty_proposal(r) for r in requests]
        new = [r.seq_id for r in active if r.seq_id not in self.runner.rows]
        if new:
            self.runner.add_rows(new)
        rows = [self.runner.row(r.seq_id) for r in active]
        self.runner.reserve(max(len(r.tokens) + self.max_nodes for r in active))
        missing = self._catch_up(rows, self.runner.sync(rows, [list(r.tokens) for r in active]))
        trees = [[_Node(r.tokens[-1], -1, 0, 0.0, column=len(m) - 1)] for r, m in zip(active, missing, strict=True)]
        # The first forward catches up; the root's next-token logits are at its last column.
        tokens: list[list[int]] = [[] for _ in self.runner.rows]
        logits_at: list[list[int]] = [[] for _ in self.runner.rows]
        for row, m in zip(rows, missing, strict=True):
            tokens[row], logits_at[row] = m, [len(m) - 1]
        logits, starts = self._forward(tokens, [chain_parents(len(t)) for t in tokens], logits_at)
        frontier = [[0] for _ in active]
        for depth in range(1, max(r.budget for r in active) + 1):
            for i, (req, row) in enumerate(zip(active, rows, strict=True)):
                for j, idx in enumerate(frontier[i]):
                    self._expand(req, trees[i], idx, logits[starts[row] + j], depth)
            frontier = [self._frontier(t, depth, r.budget) for t, r in zip(trees, active, strict=True)]
            if not any(frontier):
                break
            logits, starts = self._forward_frontier(rows, trees, frontier)
        proposals = {r.seq_id: self._proposal(r, t) for r, t in zip(active, trees, strict=True)}
        self._keep_likely_path(rows, trees)
        return [proposals.get(r.seq_id) or empty_proposal(r) for r in requests]

    def _propose_ahead(self, req: DraftRequest) -> Proposal:
        """A pre-draft (`DraftRequest.pre_draft`), rooted at the last committed token.

        The first forward brings the draft's cache to the spine's end, whose logits give the guesses of the
        bonus (the drafter's width of them); with `alternatives`, it also scores every spine node, and that
        many other tokens where the spine is likeliest cut (ranked by the draft's own confidence: the
        spine's log-probability up to the cut plus the alternative's) head chains too. Without them, the
        spine's keys and values kept from the last call (`_keep_likely_path`) are reused, so that forward
        is one token wide. Every chain grows one token per forward, so a pre-draft costs the forwards of a
        plain one, each a few tokens wider. With no spine (beside a verify of no draft, the first forward
        catching up on the prompt) nothing can be cut, and the alternatives are more guesses of the bonus:
        the draft's next most likely tokens there. With `deadline_s`, the chains stop growing (after their
        first token) before a forward whose first half would end past it (each expected to cost the last
        one): a level ending a little late delays the round by less than the token it adds is worth.
        Deterministic drafts only.
        """
        if not req.params.greedy and self.sampled:
            raise ValueError("a pre-draft's spine is for deterministic drafts; this drafter samples")
        began = time.perf_counter()
        base = replace(req, tokens=req.committed, spine=0, alternatives=0)  # what the nodes' contexts extend
        if req.seq_id not in self.runner.rows:
            self.runner.add_rows([req.seq_id])
        row = self.runner.row(req.seq_id)
        heads = self.width + req.alternatives
        self.runner.reserve(len(req.tokens) + heads * req.budget)
        nodes, logits = self._ahead_spine(req, base, row)
        s = req.spine
        guesses = self.width + (0 if s else req.alternatives)
        self._expand(base, nodes, s, logits, s + 1, width=guesses)  # the guesses of the bonus
        leaves = list(range(s + 1, len(nodes)))  # the alternatives' heads and the guesses
        last = time.perf_counter() - began  # the first forward's seconds (catch-up and spine): the estimate
        for level in range(req.budget - 1):  # the first level always: a hit takes the drafts under the guess
            now = time.perf_counter()
            if level and req.deadline_s is not None and now - began + last / 2 > req.deadline_s:
                break
            logits_k, _ = self._forward_frontier([row], [nodes], [leaves])
            last = time.perf_counter() - now
            for k, leaf in enumerate(leaves):
                self._expand(base, nodes, leaf, logits_k[k], nodes[leaf].depth + 1, width=1)
            leaves = list(range(len(nodes) - len(leaves), len(nodes)))
        proposal = self._proposal(base, nodes)
        self._keep_likely_path([row], [nodes])
        return proposal

    def _ahead_spine(self, req: DraftRequest, base: DraftRequest, row: int) -> tuple[list[_Node], torch.Tensor]:
        """The pre-draft's first forward: the root, the spine's nodes and the alternatives' heads (`nodes`),
        and the draft's logits at the spine's end ([V_draft]). Nodes already in the draft's cache have
        column -1 (`_keep_likely_path` keeps what follows them)."""
        s = req.spine
        spine = list(req.tokens[len(req.tokens) - s :])
        scored = bool(s and req.alternatives)  # every spine node's logits: where alternatives go
        synced = base.tokens if scored else req.tokens  # unscored, the spine's cached KV stays
        missing = self._catch_up([row], self.runner.sync([row], [list(synced)]))[0] + (spine if scored else [])
        n = len(missing)
        first = len(req.tokens) - n  # index in req.tokens of the first token forwarded
        tokens: list[list[int]] = [[] for _ in self.runner.rows]
        logits_at: list[list[int]] = [[] for _ in self.runner.rows]
        tokens[row], logits_at[row] = missing, list(range(n - 1 - s, n)) if scored else [n - 1]
        logits, _ = self._forward(tokens, [chain_parents(len(t)) for t in tokens], logits_at)  # [s + 1 or 1, V]
        root = len(base.tokens) - 1
        nodes = [_Node(base.tokens[-1], -1, 0, 0.0, column=max(root - first, -1))]
        cuts: list[tuple[float, int, int]] = []  # (confidence, node, token): an alternative under that node
        for j, tok in enumerate(spine):
            score = nodes[j].score
            if scored:
                confidence = torch.log_softmax(self._scores(base, nodes, j, logits[j]).float(), -1)  # [V]
                other = next(t for t in torch.topk(confidence, 2).indices.tolist() if t != tok)
                if math.isfinite(float(confidence[other])):  # not a token the request's processors rule out
                    cuts.append((score + float(confidence[other]), j, other))
                score += float(confidence[tok])
            nodes.append(_Node(tok, j, j + 1, score, column=max(root + 1 + j - first, -1)))
        for _, j, tok in sorted(cuts, reverse=True)[: req.alternatives]:
            nodes.append(_Node(tok, j, j + 1, nodes[j].score))
        return nodes, logits[-1]

    def _catch_up(self, rows: list[int], missing: list[list[int]]) -> list[list[int]]:
        """Commit chunks of long catch-ups ahead of the drafting forwards; what each row still misses."""
        size = self.catch_up_chunk
        while any(len(m) - 1 > size for m in missing):
            chunk: list[list[int]] = [[] for _ in self.runner.rows]
            for row, m in zip(rows, missing, strict=True):
                chunk[row] = m[:size] if len(m) - 1 > size else []
            self.runner.extend(chunk)
            missing = [m[len(chunk[row]) :] for row, m in zip(rows, missing, strict=True)]
        return missing

    def _scores(self, req: DraftRequest, nodes: list[_Node], idx: int, logits: torch.Tensor) -> torch.Tensor:
        """[V] the draft's scores of node `idx`'s next token (`logits`: [V_draft] there), processed as the
        target's are."""
        scores = logits[None, : self.vocab]  # [1, V]
        params = req.params
        if params.grammar is not None and (self.grammars is None or self.grammars.unavailable()):
            # no compiler here: q unmasked (drafts are proposals), p still is
            params = params.model_copy(update={"grammar": None})
        if processes(params):  # the target's processors, on this node's context
            context = node_context(req.seq_id, req.tokens, req.prompt_len, params, self.eos_ids, self.grammars)
            scores = processed(scores, context, [self._path_tokens(nodes, idx)], params)
        return scores[0]

    def _expand(
        self, req: DraftRequest, nodes: list[_Node], idx: int, logits: torch.Tensor, depth: int, width: int = 0
    ) -> None:
        """Add the children of node `idx` (`width` of them; 0: the drafter's); logits: [V_draft] next-token
        logits at that node."""
        scores = self._scores(req, nodes, idx, logits)  # [V]
        width = width or self.width
        if req.params.greedy:  # q is one-hot at the argmax: the top child has probability 1, the others 0
            for k, tok in enumerate(torch.topk(scores, width).indices.tolist()):
                nodes.append(_Node(tok, idx, depth, nodes[idx].score + (0.0 if k == 0 else -1e9)))
            return
        q = probs_from_logits(scores[None], req.params)[0]  # [V]
        nodes[idx].probs = q
        for tok in self._children(req, q, scores, depth, idx, width):
            prob = float(q[tok])
            score = nodes[idx].score + (math.log(prob) if prob > 0 else -1e9)
            nodes.append(_Node(tok, idx, depth, score))

    def _children(
        self, req: DraftRequest, q: torch.Tensor, scores: torch.Tensor, depth: int, idx: int, width: int
    ) -> list[int]:
        """Top-k by draft score (deterministic), or sampled from q without replacement."""
        if req.params.greedy or not self.sampled:
            return torch.topk(scores, width).indices.tolist()
        position = len(req.tokens) + depth - 1  # position of the drafted child
        q = q.clone()
        out: list[int] = []
        for c in range(min(width, int((q > 0).sum()))):
            tok = sample(q, uniform(req.params.seed, position, Stream.DRAFT, idx * 64 + c))
            out.append(tok)
            q[tok] = 0.0
        return out

    @staticmethod
    def _path_tokens(nodes: list[_Node], idx: int) -> list[int]:
        out = []
        while idx > 0:
            out.append(nodes[idx].token)
            idx = nodes[idx].parent
        return out[::-1]

    def _frontier(self, nodes: list[_Node], depth: int, budget: int) -> list[int]:
        """The most likely nodes at this depth to expand next, while the tree may grow.

        Which nodes grow depends on the scores of this depth only, and how many on counts only,
        never on the tokens their children will be: sampled children stay draws from q.
        """
        room = (self.max_nodes - (len(nodes) - 1)) // self.width
        if depth >= budget or room <= 0:
            return []
        fresh = [i for i, n in enumerate(nodes) if n.depth == depth]
        fresh.sort(key=lambda i: -nodes[i].score)
        return fresh[: min(self.width, room)]

    def _forward(
        self, tokens: list[list[int]], parents: list[list[int]], logits_at: list[list[int]]
    ) -> tuple[torch.Tensor, list[int]]:  # [P, V] float32 logits, row by row; each runner row's first of them
        """One draft forward: the logits asked for, unpadded (`ModelRunner.forward`), on the CPU."""
        logits = self.runner.forward(tokens, parents, logits_at)
        assert logits is not None
        return logits.float().cpu(), row_offsets([len(a) for a in logits_at])

    def _forward_frontier(
        self, rows: list[int], trees: list[list[_Node]], frontier: list[list[int]]
    ) -> tuple[torch.Tensor, list[int]]:
        tokens: list[list[int]] = [[] for _ in self.runner.rows]
        parents: list[list[int]] = [[] for _ in self.runner.rows]
        n_spec = self.runner.spec.tokens.shape[1]
        for i, row in enumerate(rows):
            for j, idx in enumerate(frontier[i]):
                node = trees[i][idx]
                node.column = n_spec + j
                tokens[row].append(node.token)
                parents[row].append(trees[i][node.parent].column)
        return self._forward(tokens, parents, [list(range(len(t))) for t in tokens])

    def _proposal(self, req: DraftRequest, nodes: list[_Node]) -> Proposal:
        """The tree in node order (parents before children, children in draft order).

        Every drafted node is kept: pruning by value would bias sampled children away from q.
        """
        order = sorted(range(len(nodes)), key=lambda i: (nodes[i].depth, i))
        node_of = {idx: k for k, idx in enumerate(order)}
        tree = TokenTree(
            req.tokens[-1],
            tuple(nodes[i].token for i in order[1:]),
            tuple(node_of[nodes[i].parent] for i in order[1:]),
        )
        if req.params.greedy or not self.sampled:
            return Proposal(tree)
        q = torch.zeros(tree.size + 1, self.target_vocab)  # [n+1, V_target]
        for k, idx in enumerate(order):
            probs = nodes[idx].probs
            if probs is not None:
                q[k, : self.vocab] = probs
        return Proposal(tree, q)

    def _keep_likely_path(self, rows: list[int], trees: list[list[_Node]]) -> None:
        """Tentatively commit the catch-up tokens and the most likely forwarded path (up from its deepest
        node to the root, or to a node that was in the cache already: column -1)."""
        keep: list[list[int]] = [[] for _ in self.runner.rows]  # rows not drafted: nothing new
        for i, row in enumerate(rows):
            nodes = trees[i]
            forwarded = [k for k, n in enumerate(nodes) if n.column >= 0]
            best = max(forwarded, key=lambda k: (nodes[k].depth, nodes[k].score))
            path = []
            while best > 0 and nodes[best].column >= 0:
                path.append(nodes[best].column)
                best = nodes[best].parent
            keep[row] = list(range(nodes[0].column + 1)) + path[::-1]
        self.runner.commit(keep)
