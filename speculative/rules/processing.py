"""A request's logits processors: the same on the draft's scores and on the target's at every node.

Run before the temperature, in vLLM's order: `min_tokens` (end tokens banned until that many are
out), `logit_bias` (added per token id), then the penalties: repetition (HF/CTRL, over prompt and
output), frequency and presence (OpenAI's, over the output only: each token's logit minus
frequency x its count minus presence if it occurred), and last the grammar's mask (structured
output, `grammar.py`: -inf on every token the grammar disallows after that node). Node i of a
tree sees its own context: the committed tokens plus the draft tokens on the path to it, so a
verify forward's n+1 rows are processed exactly as n+1 plain decoding steps would be, and draft
and target transform alike.

Example: output so far [5, 7, 5], frequency 0.5, presence 1.0, a node whose path adds [7]: token 5
loses 0.5 x 2 + 1.0 = 2.0, token 7 loses 0.5 x 2 + 1.0 = 2.0, token 9 nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from speculative.rules.sampling import SamplingParams, apply_repetition_penalty, context_seen

if TYPE_CHECKING:
    from speculative.rules.grammar import GrammarCompiler

# (paths [N] of draft tokens after the committed ones, vocabulary size) -> [N, V] bool: allowed tokens
PathMask = Callable[[list[list[int]], int], torch.Tensor]


@dataclass(frozen=True)
class NodeContext:
    """What processing reads of a sequence besides the logits."""

    tokens: Sequence[int]  # committed tokens, prompt first; the tree's root last
    prompt_len: int  # how many of them are the prompt (penalties by output count read after it)
    eos_ids: frozenset[int] = frozenset()  # ended by these unless ignore_eos (banned before min_tokens)
    mask: PathMask | None = None  # the request's grammar over this sequence (`grammar.GrammarCompiler.path_mask`)


def node_context(
    seq_id: str,
    tokens: Sequence[int],
    prompt_len: int,
    params: SamplingParams,
    eos_ids: frozenset[int],
    grammars: GrammarCompiler | None,
) -> NodeContext:
    """A sequence's context, with its grammar's node masks when the request has a grammar."""
    if params.grammar is None or grammars is None:
        return NodeContext(tokens, prompt_len, eos_ids)  # no compiler: `processed` refuses the grammar
    ends = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_ids)
    mask = grammars.path_mask(seq_id, tokens[prompt_len:], params.grammar, ends)
    return NodeContext(tokens, prompt_len, eos_ids, mask)


def processes(params: SamplingParams) -> bool:
    """True when `processed` changes the logits (greedy rows then need them, not only each argmax)."""
    return params.uses_penalty or bool(params.logit_bias) or params.min_tokens > 0 or params.grammar is not None


def processed(
    logits: torch.Tensor,  # [N, V] float32: row r = next-token scores after `paths[r]`
    context: NodeContext,
    paths: list[list[int]],  # [N] draft tokens between the committed tokens and row r's position
    params: SamplingParams,
) -> torch.Tensor:  # [N, V]
    if not processes(params):
        return logits
    vocab = logits.shape[-1]
    raw = logits
    logits = logits.clone()
    if params.min_tokens:
        ban = _ending_tokens(context, params, vocab)
        produced = len(context.tokens) - context.prompt_len
        rows = [r for r, path in enumerate(paths) if produced + len(path) < params.min_tokens]
        if rows and ban:
            logits[torch.tensor(rows)[:, None], torch.tensor(ban)[None, :]] = float("-inf")
    if params.logit_bias:
        ids = [(t, b) for t, b in params.logit_bias if t < vocab]
        if ids:
            logits[:, torch.tensor([t for t, _ in ids])] += torch.tensor([b for _, b in ids])
    if params.repetition_penalty != 1.0:
        seen = context_seen(list(context.tokens), paths, vocab)
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.frequency_penalty or params.presence_penalty:
        counts = output_counts(context, paths, vocab)  # [N, V]
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    if params.grammar is not None:
        logits = _grammar_masked(logits, raw, context, paths)
    return logits


def _grammar_masked(
    logits: torch.Tensor,  # [N, V] processed
    raw: torch.Tensor,  # [N, V] as they came
    context: NodeContext,
    paths: list[list[int]],
) -> torch.Tensor:  # [N, V]
    """-inf on the tokens the grammar disallows. A row left nothing (the grammar can only end where
    min_tokens bans the end tokens) takes the grammar's tokens from the raw logits: the grammar wins."""
    if context.mask is None:
        raise ValueError("grammar: no grammar compiler for this model (its tokenizer is not loaded)")
    allowed = context.mask(paths, logits.shape[-1]).to(logits.device)  # [N, V] bool
    masked = logits.masked_fill(~allowed, float("-inf"))
    dead = torch.isneginf(masked).all(-1)  # [N]
    if bool(dead.any()):
        masked[dead] = raw[dead].masked_fill(~allowed[dead], float("-inf"))
    return masked


def output_counts(context: NodeContext, paths: list[list[int]], vocab: int) -> torch.Tensor:  # [N, V] float32
    """How often each token occurs in each row's output: the committed output plus the row's path."""
    output = [t for t in context.tokens[context.prompt_len :] if t < vocab]
    base = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab).float()  # [V]
    counts = base.expand(len(paths), vocab).clone()
    for row, path in enumerate(paths):
        kept = [t for t in path if t < vocab]
        if kept:
            counts[row] += torch.bincount(torch.tensor(kept, dtype=torch.long), minlength=vocab).float()
    return counts


def _ending_tokens(context: NodeContext, params: SamplingParams, vocab: int) -> list[int]:
    """The tokens that would end the sequence (`stopping.check_stop`'s), within the vocabulary."""
    ending = set(params.stop_token_ids) | (set() if params.ignore_eos else set(context.eos_ids))
    return sorted(t for t in ending if t < vocab)
