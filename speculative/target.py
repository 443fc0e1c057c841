"""The target side of a step: verify each sequence's tree in one batched forward and commit.

The cache holds every committed token but the last (the tree's root). A sequence the verifier has
not seen, or whose cache disagrees with the tokens it is sent (a restart, a rollback, a replica
change), is re-prefilled in the same forward: its missing tokens go in as a chain with the tree
hung after them. A miss costs time, never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculative.acceptance import Verdict, follow_choices
from speculative.drafters.base import Proposal
from speculative.packing import row_offsets
from speculative.runner import ModelRunner, chain_parents
from speculative.sampling import SamplingParams
from speculative.verify import argmax_decides, verify_tree


@dataclass(frozen=True)
class VerifyItem:
    seq_id: str
    tokens: tuple[int, ...]  # committed tokens, prompt included; the last is the tree's root
    params: SamplingParams
    proposal: Proposal


class TargetVerifier:
    """Verification of many sequences' trees against one target model."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def verify(self, items: list[VerifyItem]) -> list[Verdict]:
        if not items:
            return []
        for item in items:
            if item.proposal.tree.root != item.tokens[-1]:
                raise ValueError(f"{item.seq_id}: tree root is not the last committed token")
        new = [i.seq_id for i in items if i.seq_id not in self.runner.rows]
        if new:
            self.runner.add_rows(new)
        rows = [self.runner.row(i.seq_id) for i in items]
        missing = self.runner.sync(rows, [list(i.tokens) for i in items])
        tokens: list[list[int]] = [[] for _ in self.runner.rows]
        parents: list[list[int]] = [[] for _ in self.runner.rows]
        logits_at: list[list[int]] = [[] for _ in self.runner.rows]
        offsets = []
        for item, row, miss in zip(items, rows, missing, strict=True):
            off = len(miss) - 1  # catch-up tokens before the root
            tree = item.proposal.tree
            tokens[row] = miss[:-1] + list(tree.all_tokens)
            parents[row] = chain_parents(off) + [p + off if p >= 0 else off - 1 for p in tree.runner_parents()]
            logits_at[row] = list(range(off, off + tree.size + 1))
            offsets.append(off)
        logits = self.runner.forward_packed(tokens, parents, logits_at)  # [P, V], model's device
        assert logits is not None
        starts = row_offsets([len(a) for a in logits_at])  # each runner row's first logits row
        # Greedy rows without penalties need only each node's argmax: taken where the logits are, so
        # only [P] ids cross to the CPU; the others get float32 distributions there.
        argmax_only = [argmax_decides(item.params) for item in items]
        best = logits.argmax(-1).cpu() if any(argmax_only) else None  # [P]
        sizes = {row: item.proposal.tree.size + 1 for item, row in zip(items, rows, strict=True)}  # root included
        spans = {row: slice(starts[row], starts[row] + n) for row, n in sizes.items()}
        full = [row for row, a in zip(rows, argmax_only, strict=True) if not a]
        host: dict[int, torch.Tensor] = {}  # row -> [n+1, V] float32 on the CPU, in one transfer
        if full:
            index = torch.cat([torch.arange(starts[r], starts[r] + sizes[r]) for r in full]).to(logits.device)
            moved = logits[index].float().cpu().split([sizes[r] for r in full])
            host = dict(zip(full, moved, strict=True))
        verdicts: list[Verdict] = []
        keep: list[list[int]] = [[] for _ in self.runner.rows]
        for item, row, off, a in zip(items, rows, offsets, argmax_only, strict=True):
            if a:
                assert best is not None
                verdict = follow_choices(item.proposal.tree, best[spans[row]].tolist())
            else:
                verdict = verify_tree(item.proposal, host[row], list(item.tokens), item.params)
            verdicts.append(verdict)
            keep[row] = list(range(off)) + [off + node for node in verdict.path]
        self.runner.commit(keep)
        return verdicts

    def release(self, seq_ids: list[str]) -> None:
        known = [s for s in seq_ids if s in self.runner.rows]
        if known:
            self.runner.remove_rows(known)

    def cached_sequences(self) -> int:
        """Sequences whose KV this verifier holds (rows of its runner)."""
        return len(self.runner.rows)
