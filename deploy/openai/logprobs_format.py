"""The router's per-token log probabilities in OpenAI's two response formats.

Router entries (`actors/records.with_logprobs`): {"token": id, "logprob": float, "top": [[id, logprob], ...]},
the target's raw log_softmax (before temperature and the request's processors; vLLM's default).

Completions (legacy): {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{text: logprob}, ...],
"text_offset": [...]}, each top map holding the `logprobs` most likely tokens and the chosen one.
Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]},
`top_logprobs` most likely tokens per position.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

TokenText = Callable[[int], str]  # a token id's text on its own


def completion_logprobs(entries: list[dict[str, Any]], text: TokenText, offset: int = 0) -> dict[str, Any]:
    """`offset`: characters of the choice's text before these tokens (text_offset counts from there)."""
    tokens, offsets = [], []
    for entry in entries:
        offsets.append(offset)
        piece = text(entry["token"])
        tokens.append(piece)
        offset += len(piece)
    top = []
    for entry in entries:
        alternatives = {text(t): lp for t, lp in entry["top"]}
        alternatives.setdefault(text(entry["token"]), entry["logprob"])
        top.append(alternatives)
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[dict[str, Any]], text: TokenText) -> dict[str, Any]:
    def item(token: int, logprob: float) -> dict[str, Any]:
        piece = text(token)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}

    content = [{**item(e["token"], e["logprob"]), "top_logprobs": [item(t, lp) for t, lp in e["top"]]} for e in entries]
    return {"content": content, "refusal": None}
