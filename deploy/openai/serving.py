"""A completions or chat request run on the router: its choices' sequences, and OpenAI's response of them.

Every choice is a sequence of its own (deploy/openai/choices.py); they run side by side. Without
`stream`, the response holds the choices in index order; with it, each choice's chunks go out as
they come, carrying its index (chat: a first chunk with the role for each). `usage` sums the
choices: the completion tokens of all, the prompt tokens once per prompt, and the acceptance
length over all their target forwards. A choice that fails ends the request: before the first
chunk as a status code, after it as an error event; the other choices' sequences are cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Coroutine
from typing import Any, TypeVar

from fastapi.responses import JSONResponse, Response, StreamingResponse

from actors.router import StreamTimeout
from deploy.front.frontdoor import Backend, Detokenizer, FrontDoor, RequestError, client_error
from deploy.openai.answer import Answer
from deploy.openai.api import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChunkChoice,
    Completion,
    CompletionChoice,
    Delta,
    ErrorBody,
    Metrics,
    SpecDecodeMetrics,
    Usage,
    new_id,
    prediction_usage,
)
from deploy.openai.choices import Choice, OpenAIRequest, Plan, plan_request
from deploy.openai.logprobs_format import TokenText, chat_logprobs, completion_logprobs
from deploy.openai.unknown_fields import ignored_header

logger = logging.getLogger(__name__)
Stream = AsyncIterator[dict[str, Any]]
T = TypeVar("T")


async def serve(backend: Backend, front: FrontDoor, cls: type[OpenAIRequest], body: bytes) -> Response:
    """The response to one POST /v1/completions or /v1/chat/completions body."""
    info = await backend.info()
    window = front.served_window(info)
    budget = info.get("kv_budget_tokens")
    plan = await front.off_loop(plan_request, front, cls, body, secrets.randbits(63), window, budget)
    headers = ignored_header(plan.ignored)
    eos = frozenset(int(t) for t in info.get("eos_ids", ()))
    detoks = {c.index: detokenizer(front, plan.request, c.sampling, eos) for c in plan.choices}
    if plan.request.stream:
        opened = await open_choices(backend, plan)
        headers |= {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(_events(plan, front, detoks, opened), media_type="text/event-stream", headers=headers)
    results = await generate_choices(backend, plan)
    for c, r in zip(plan.choices, results, strict=True):
        r["usage"] = await counted_usage(front, r.get("usage") or {}, c, list(r["token_ids"]))
    texts = [
        c.echo + await front.detokenize(detoks[c.index], list(r["token_ids"]), r["finish_reason"])
        for c, r in zip(plan.choices, results, strict=True)
    ]
    response = _full_response(plan, front, texts, results, token_text(front))
    return JSONResponse(response.model_dump(mode="json"), headers=headers)


def token_text(front: FrontDoor) -> TokenText:
    """A token's own text for log probabilities (special tokens shown: they are what was emitted)."""
    return lambda token: front.decode([token], skip_special_tokens=False)


def logprobs_of(chat: bool, entries: list[dict[str, Any]] | None, text: TokenText, offset: int = 0) -> Any:
    """A choice's (or a chunk's) `logprobs` in the endpoint's format; None when the request asked none."""
    if entries is None:
        return None
    return chat_logprobs(entries, text) if chat else completion_logprobs(entries, text, offset)


def detokenizer(front: FrontDoor, request: OpenAIRequest, sampling: dict[str, Any], eos: frozenset[int]) -> Detokenizer:
    """A choice's text as the request asks for it: special tokens skipped or not, stop strings kept or cut."""
    stop_ids = frozenset(sampling["stop_token_ids"]) | (frozenset() if sampling["ignore_eos"] else eos)
    decode = functools.partial(front.decode, skip_special_tokens=request.skip_special_tokens is not False)
    return Detokenizer(decode, tuple(sampling["stop"]), bool(request.include_stop_str_in_output), stop_ids)


async def _admitted(choice: Choice, call: Awaitable[T]) -> T:
    """`call`'s result; the router's refusal of the choice's input as a RequestError naming its field."""
    try:
        return await call
    except Exception as e:
        if (error := client_error(e, choice.prompt_param)) is None:
            raise  # Overloaded -> 429 (its handler); anything else -> 500
        raise error from e


async def _all(calls: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Every call's result, run side by side; the first failure cancels the others (and is raised)."""
    if len(calls) == 1:
        return [await calls[0]]
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # done ones are left as they are
        await asyncio.gather(*tasks, return_exceptions=True)


async def generate_choices(backend: Backend, plan: Plan) -> list[dict[str, Any]]:
    """Every choice run to completion."""
    return await _all([_admitted(c, backend.generate(c.prompt_ids, c.sampling)) for c in plan.choices])


async def open_choices(backend: Backend, plan: Plan) -> list[tuple[Choice, dict[str, Any], Stream]]:
    """Each choice's stream with its first chunk: admission happens there, so its errors still get a status."""
    streams = [backend.generate_stream(c.prompt_ids, c.sampling) for c in plan.choices]
    try:
        firsts = await _all([_admitted(c, anext(s)) for c, s in zip(plan.choices, streams, strict=True)])
    except BaseException:
        await close_streams(streams)  # the admitted ones' sequences are cancelled
        raise
    return list(zip(plan.choices, firsts, streams, strict=True))


async def merged_chunks(
    opened: list[tuple[Choice, dict[str, Any], Stream]],
) -> AsyncGenerator[tuple[Choice, dict[str, Any]], None]:
    """Each choice's chunks, its first first, in the order they come; ends once every choice has finished."""
    if len(opened) == 1:
        choice, chunk, stream = opened[0]
        yield choice, chunk
        while chunk["finish_reason"] is None:
            chunk = await anext(stream)
            yield choice, chunk
        return
    queue: asyncio.Queue[tuple[Choice, dict[str, Any] | Exception]] = asyncio.Queue()

    async def pump(choice: Choice, chunk: dict[str, Any], stream: Stream) -> None:
        try:
            queue.put_nowait((choice, chunk))
            while chunk["finish_reason"] is None:
                chunk = await anext(stream)
                queue.put_nowait((choice, chunk))
        except BaseException as e:  # the consumer must hear of it, or it waits for this choice forever
            error = e if isinstance(e, Exception) else RuntimeError(f"choice {choice.index} was cancelled")
            queue.put_nowait((choice, error))
            raise

    tasks = [asyncio.ensure_future(pump(*o)) for o in opened]
    try:
        running = len(tasks)
        while running:
            choice, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            yield choice, item
            if item["finish_reason"] is not None:
                running -= 1
    finally:
        for task in tasks:
            task.cancel()  # before the streams close: a stream cannot close while a pump awaits it
        await asyncio.gather(*tasks, return_exceptions=True)


def request_metrics(front: FrontDoor, usages: list[dict[str, Any]]) -> Metrics | None:
    """The response's `metrics` where `front_door.per_request_spec_decode_metrics` asks for them."""
    if not front.config.per_request_spec_decode_metrics:
        return None
    return Metrics(speculative_decoding=SpecDecodeMetrics.of(usages))


def _full_response(
    plan: Plan, front: FrontDoor, texts: list[str], results: list[dict[str, Any]], text_of: TokenText
) -> Completion | ChatCompletion:
    usages = [r.get("usage") or {} for r in results]
    usage, metrics, model = summed_usage(plan.choices, usages), request_metrics(front, usages), front.model_name
    pairs = list(zip(plan.choices, texts, results, strict=True))

    def token_ids(result: dict[str, Any]) -> list[int] | None:
        return list(result["token_ids"]) if plan.request.return_token_ids else None

    if plan.chat:
        rid, created = new_id("chatcmpl")
        chats = []
        for c, text, r in pairs:
            message, reason = Answer.of(plan.tools, plan.thinks).message(text, r["finish_reason"])
            logprobs = logprobs_of(True, r.get("logprobs"), text_of)
            chats.append(
                ChatChoice(
                    index=c.index, message=message, logprobs=logprobs, finish_reason=reason, token_ids=token_ids(r)
                )
            )
        return ChatCompletion(id=rid, created=created, model=model, choices=chats, usage=usage, metrics=metrics)
    rid, created = new_id("cmpl")
    completions = [
        CompletionChoice(
            index=c.index,
            text=text,
            logprobs=logprobs_of(False, r.get("logprobs"), text_of, len(c.echo)),
            finish_reason=r["finish_reason"],
            token_ids=token_ids(r),
        )
        for c, text, r in pairs
    ]
    return Completion(id=rid, created=created, model=model, choices=completions, usage=usage, metrics=metrics)


async def counted_usage(front: FrontDoor, usage: dict[str, Any], choice: Choice, output: list[int]) -> dict[str, Any]:
    """A finished choice's usage, with the Predicted Outputs counts where it had a prediction."""
    if not choice.sampling.get("prediction"):
        return usage
    return await front.off_loop(prediction_usage, usage, choice.sampling, output)


def summed_usage(choices: list[Choice], usages: list[dict[str, Any]]) -> Usage:
    """The request's usage of its choices' (the router's usage dicts, in the choices' order)."""
    if len(usages) == 1:
        return Usage.from_router(usages[0])
    prompts = {c.prompt_index: int(u.get("prompt_tokens", 0)) for c, u in zip(choices, usages, strict=True)}
    steps, accepted = (sum(int(u.get(key, 0)) for u in usages) for key in ("steps", "accepted"))
    predicted = [u["predicted"] for u in usages if "predicted" in u]
    summed = {k: sum(p[k] for p in predicted) for k in predicted[0]} if predicted else None
    return Usage.from_router(
        {
            "predicted": summed,
            "prompt_tokens": sum(prompts.values()),
            "completion_tokens": sum(int(u.get("completion_tokens", 0)) for u in usages),
            "drafted": sum(int(u.get("drafted", 0)) for u in usages),
            "accepted": accepted,
            "acceptance_length": (accepted + steps) / steps if steps else 0.0,
        }
    )


async def _events(
    plan: Plan,
    front: FrontDoor,
    detoks: dict[int, Detokenizer],
    opened: list[tuple[Choice, dict[str, Any], Stream]],
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`."""
    request, chat = plan.request, plan.chat
    rid, created = new_id("chatcmpl" if chat else "cmpl")
    model = front.model_name
    include_usage = request.stream_options is not None and request.stream_options.include_usage

    def event(choices: list[Any], usage: Usage | None = None, metrics: Metrics | None = None) -> str:
        cls = ChatCompletionChunk if chat else Completion
        body = cls(id=rid, created=created, model=model, choices=choices, usage=usage, metrics=metrics)
        return f"data: {body.model_dump_json()}\n\n"

    def choice(
        index: int,
        text: str | None,
        ids: list[int],
        reason: str | None,
        role: bool = False,
        logprobs: Any = None,
        delta: Delta | None = None,
    ) -> Any:
        token_ids = ids if request.return_token_ids else None
        if chat:
            delta = delta or Delta(role="assistant" if role else None, content=text)
            return ChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=reason, token_ids=token_ids)  # type: ignore[arg-type]
        return CompletionChoice(
            index=index, text=text or "", logprobs=logprobs, finish_reason=reason, token_ids=token_ids
        )  # type: ignore[arg-type]

    text_of = token_text(front)
    offsets = {c.index: len(c.echo) for c in plan.choices}  # completions' text_offset of each choice's next token
    answers = {c.index: Answer.of(plan.tools, plan.thinks) for c in plan.choices} if chat else {}  # chat's readers

    usages: dict[int, dict[str, Any]] = {}
    outputs: dict[int, list[int]] = {}  # each choice's token ids so far (for prediction counts)
    try:
        for c in plan.choices:
            if chat or c.echo:  # the role of each chat choice; the prompt of each echoed one
                yield event([choice(c.index, c.echo, [], None, role=chat)])
        async with contextlib.aclosing(merged_chunks(opened)) as chunks:  # closed here: before the streams
            async for c, chunk in chunks:
                ids, reason = list(chunk["token_ids"]), chunk["finish_reason"]
                text = await front.detokenize(detoks[c.index], ids, reason)
                logprobs = logprobs_of(chat, chunk.get("logprobs"), text_of, offsets[c.index])
                if logprobs is not None and not chat:
                    offsets[c.index] += sum(len(t) for t in logprobs["tokens"])
                delta: Delta | None = None
                if chat:
                    delta, reason = answers[c.index].delta(text, reason)
                said = delta is not None if chat else bool(text)
                if said or reason is not None or (ids and (request.return_token_ids or logprobs is not None)):
                    yield event([choice(c.index, text or None, ids, reason, logprobs=logprobs, delta=delta or Delta())])
                if c.sampling.get("prediction"):
                    outputs.setdefault(c.index, []).extend(ids)
                if reason is not None:
                    usages[c.index] = await counted_usage(front, chunk.get("usage") or {}, c, outputs.pop(c.index, []))
        if include_usage:
            every = [usages[c.index] for c in plan.choices]
            yield event([], summed_usage(plan.choices, every), request_metrics(front, every))
    except Exception as e:  # the status line is sent: report in the stream, as OpenAI and vLLM do
        logger.exception("stream failed")
        code = "stream_timeout" if isinstance(e, StreamTimeout) else "internal_error"
        error = RequestError(f"generation failed: {e}", status=500, type="server_error", code=code)
        yield f"data: {ErrorBody.of(error).model_dump_json()}\n\n"
    finally:
        await close_streams([stream for _, _, stream in opened])  # on client disconnect too: the router cancels
    yield "data: [DONE]\n\n"


async def close_streams(streams: list[Stream]) -> None:
    for stream in streams:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
