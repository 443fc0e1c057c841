"""The router's results as specserve.v1 messages: choices, per-token log probabilities, usage.

Router chunks and results are dicts (`actors/router.py`): token_ids, finish_reason, usage, and where
`sampling.logprobs` asks, logprobs entries {"token": id, "logprob": float, "top": [[id, logprob], ...]}
(`actors/records.with_logprobs`). Text comes from each choice's `Detokenizer`, which the caller feeds in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deploy.openai.api import Usage
from deploy.openai.tools import DeltaToolCall, OutToolCall
from proto import specserve_pb2 as pb

FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "tool_calls": pb.FINISH_REASON_TOOL_CALLS}


def finish_reason(reason: str | None) -> pb.FinishReason:
    return FINISH.get(reason or "", pb.FINISH_REASON_UNSPECIFIED)


def token_logprobs(entries: list[dict[str, Any]] | None) -> list[pb.TokenLogprob]:
    """One message per output token; none where the request asked for no log probabilities."""
    return [
        pb.TokenLogprob(
            token_id=e["token"],
            logprob=e["logprob"],
            top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in e["top"]],
        )
        for e in entries or ()
    ]


def usage_message(usage: Usage) -> pb.Usage:
    """The HTTP API's usage (one choice's, or summed over a request's) as the proto's."""
    message = pb.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        draft_tokens=usage.draft_tokens,
        accepted_tokens=usage.accepted_tokens,
        acceptance_length=usage.acceptance_length,
    )
    predicted = usage.completion_tokens_details
    if predicted is not None:  # the request had a prediction
        message.accepted_prediction_tokens = predicted.accepted_prediction_tokens
        message.rejected_prediction_tokens = predicted.rejected_prediction_tokens
    return message


def tool_calls(calls: Sequence[OutToolCall | DeltaToolCall]) -> list[pb.ToolCall]:
    """The calls a choice's output made (the HTTP API's, whole or as a stream's delta of whole calls)."""
    return [pb.ToolCall(id=c.id or "", name=c.function.name or "", arguments=c.function.arguments or "") for c in calls]


def choice_message(
    index: int, result: dict[str, Any], text: str, calls: Sequence[OutToolCall] = (), reason: str | None = None
) -> pb.Choice:
    """A choice run to completion (`Router.generate`'s result) and its whole text; `calls` and `reason`: the tool
    calls read out of it and its finish reason then (`tool_calls`), where the request has tools."""
    return pb.Choice(
        index=index,
        token_ids=result["token_ids"],
        text=text,
        finish_reason=finish_reason(reason or result["finish_reason"]),
        logprobs=token_logprobs(result.get("logprobs")),
        tool_calls=tool_calls(calls),
    )


def unary_response(choices: list[pb.Choice], usage: Usage, model: str, request_id: str) -> pb.GenerateResponse:
    """Every choice, choice 0's also in the top-level fields (what a client of one choice reads)."""
    first = choices[0]
    return pb.GenerateResponse(
        token_ids=first.token_ids,
        text=first.text,
        finish_reason=first.finish_reason,
        usage=usage_message(usage),
        model=model,
        choices=choices,
        request_id=request_id,
        tool_calls=first.tool_calls,
    )


def stream_message(
    index: int,
    chunk: dict[str, Any],
    text: str,
    request_id: str,
    calls: Sequence[DeltaToolCall] = (),
    reason: str | None = None,
) -> pb.GenerateStreamResponse:
    """One router chunk of choice `index`; its last carries the choice's usage (with the prediction's counts, where
    the caller added them: `serving.counted_usage`). `calls`, `reason`: the tool calls its text completes and the
    choice's finish reason then, where the request has tools."""
    message = pb.GenerateStreamResponse(
        token_ids=chunk["token_ids"],
        text=text,
        finish_reason=finish_reason(reason or chunk["finish_reason"]),
        index=index,
        logprobs=token_logprobs(chunk.get("logprobs")),
        request_id=request_id,
        tool_calls=tool_calls(calls),
    )
    if chunk["finish_reason"] is not None:
        message.usage.CopyFrom(usage_message(Usage.from_router(chunk.get("usage") or {})))
    return message
