"""Verification of one sequence's tree from the target's logits: the rule docs/design.md assigns.

- greedy request: `accept_greedy` on penalised logits;
- sampled request, deterministic draft (top-k tree, greedy chain, prompt lookup): target-sample
  matching;
- sampled request, draft sampled from q: recursive rejection sampling.
"""

from __future__ import annotations

import torch

from speculative.rules.acceptance import Verdict, accept_by_rejection, accept_by_target_sample, accept_greedy
from speculative.rules.processing import NodeContext, processed, processes
from speculative.rules.proposal import Proposal
from speculative.rules.rng import KeyedDraws, Stream
from speculative.rules.sampling import SamplingParams, probs_from_logits


def argmax_decides(params: SamplingParams) -> bool:
    """True when a verdict depends only on each node's argmax (greedy, no logits processor), so a
    caller may reduce logits to argmax where they are and use `acceptance.follow_choices`."""
    return params.greedy and not processes(params)


def verify_tree(
    proposal: Proposal,
    logits: torch.Tensor,  # [n+1, V] target logits at the tree's nodes, node order
    context: NodeContext,  # committed tokens (the tree's root last), prompt length, end tokens
    params: SamplingParams,
) -> Verdict:
    tree = proposal.tree
    if processes(params):
        paths = [tree.path_tokens(node) for node in range(tree.size + 1)]
        logits = processed(logits, context, paths, params)
    if params.greedy:
        return accept_greedy(tree, logits)
    probs = probs_from_logits(logits, params)  # [n+1, V]
    keyed = KeyedDraws(params.seed, Stream.TARGET)
    base = len(context.tokens)  # position of the first token this step emits

    def draw(depth: int, index: int) -> float:
        return keyed(base + depth, index)

    if proposal.draft_probs is not None:
        return accept_by_rejection(tree, probs, proposal.draft_probs, draw)
    return accept_by_target_sample(tree, probs, draw)
