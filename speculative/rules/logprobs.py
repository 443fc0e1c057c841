"""Log probabilities of the emitted tokens, from the target's logits at the nodes that emitted them.

They describe the target's raw distribution, log_softmax of its logits before the request's
processors, temperature, min-p, top-k or top-p (vLLM's default, `raw_logprobs`), so they are the
same whether a token came from an accepted draft or from the target: token j of a verdict was
chosen at node path[j] of the tree, and that node's logits are the ones a plain decoding step
would compute at the same position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log probability and the most likely alternatives at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log probability), most likely first


def token_logprobs(
    logits: torch.Tensor,  # [m, V] the target's logits at the emitting nodes, in emission order
    tokens: tuple[int, ...],  # [m] the tokens emitted there
    top: int,  # alternatives per token (0: only the token's own)
) -> tuple[TokenLogprob, ...]:
    logp = logits.float().log_softmax(-1)  # [m, V]
    chosen = logp[torch.arange(len(tokens), device=logp.device), torch.tensor(tokens, device=logp.device)]
    chosen_list = chosen.tolist()
    if top == 0:
        return tuple(TokenLogprob(t, lp, ()) for t, lp in zip(tokens, chosen_list, strict=True))
    values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)  # [m, top]
    pairs = [tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return tuple(TokenLogprob(t, lp, p) for t, lp, p in zip(tokens, chosen_list, pairs, strict=True))
