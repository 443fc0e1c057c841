"""The gRPC front door: `specserve.v1.SpecServe` (proto/specserve.proto) and grpc.health.v1's `Check` over the router.

Serve's gRPC proxy (`grpc_options.grpc_servicer_functions = GRPC_SERVICER_FUNCTIONS`, deploy/front/grpc_decoding.py)
calls the ingress deployment's methods named like the RPCs with the request proto, passing its
`RayServegRPCContext` as `grpc_context`; a unary method returns the response, a streaming one yields them.
`GrpcIngress` is those methods, a mixin for the Router class (deploy/ingress.py). A request is planned by the
HTTP front door's code (deploy/grpc/request.py) and its choices run as HTTP runs them (deploy/openai/serving.py).
Errors are status codes with details naming the field by its proto path:

    INVALID_ARGUMENT    bad input ("sampling.top_p: ...", "text: must not be empty")
    NOT_FOUND           an unknown `model`; a health Check of a service this server does not serve
    UNAUTHENTICATED     an API key is configured and `authorization: Bearer <key>` is missing/wrong
    RESOURCE_EXHAUSTED  the router is full (actors.router.Overloaded); trailing `retry-after` seconds
                        (and "retry after N s" in the details, which survive Serve's proxy on streams);
                        or the request is over `front_door.max_request_bytes` serialized
    DEADLINE_EXCEEDED   a stream ran past `router_pool.router.max_stream_s` (after the messages sent so far)

A call the client cancels is cancelled here too (Serve's proxy cancels the replica's call): the router's
streams of its choices close, and the router drops their sequences. Health and Check need no API key, as
GET /health: probes send none. Tokenizing runs on the front door's threads (`FrontDoor.off_loop`), as on HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import grpc
from grpc_health.v1 import health_pb2

from actors.router import Overloaded, StreamTimeout
from deploy.front.frontdoor import Backend, FrontDoor, RequestError, too_large
from deploy.front.grpc_decoding import Undecodable
from deploy.grpc.request import plan_generation, renamed, request_id
from deploy.grpc.response import choice_message, stream_message, unary_response
from deploy.openai.answer import Answer
from deploy.openai.choices import Plan
from deploy.openai.serving import (
    close_streams,
    counted_usage,
    detokenizer,
    generate_choices,
    merged_chunks,
    open_choices,
    summed_usage,
)
from proto import specserve_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["SpecServe"].full_name  # what a health Check names: specserve.v1.SpecServe
_HTTP_TO_GRPC = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class StatusContext(Protocol):
    """What the methods use of a gRPC context: Serve's RayServegRPCContext (tests: a recording one)."""

    def invocation_metadata(self) -> Sequence[tuple[str, Any]]: ...
    def set_code(self, code: grpc.StatusCode) -> None: ...
    def set_details(self, details: str) -> None: ...
    def set_trailing_metadata(self, trailing_metadata: list[tuple[str, str]]) -> None: ...


class GrpcStatus(Exception):
    """A refused request, as a gRPC status code, details and trailing metadata."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: list[tuple[str, str]] | None = None) -> None:
        super().__init__(code, details, trailing)  # all in args: it pickles (Serve sends it to the proxy)
        self.code, self.details, self.trailing = code, details, trailing or []

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"

    def apply(self, context: StatusContext | None) -> None:
        if context is None:
            raise self
        context.set_code(self.code)
        context.set_details(self.details)
        if self.trailing:
            context.set_trailing_metadata(self.trailing)


@dataclass(frozen=True)
class Admitted:
    """A request past the front door's checks: its choices, its id, its prompt field, the model's end ids."""

    plan: Plan
    request_id: str
    prompt: str  # text, token_ids or chat: how errors about the prompt name it
    eos: frozenset[int]


class GrpcIngress:
    """Mixin for the ingress deployment class: the RPCs of specserve.v1.SpecServe and grpc.health.v1.Health/Check."""

    front: FrontDoor  # set by the combined class's constructor

    async def Generate(
        self, request: pb.GenerateRequest, grpc_context: StatusContext | None = None
    ) -> pb.GenerateResponse:
        backend, front = cast(Backend, self), self.front
        try:
            admitted = await _admit(backend, front, request, grpc_context)
            results = await _refused_as_status(generate_choices(backend, admitted.plan), front, admitted.prompt)
        except GrpcStatus as status:
            status.apply(grpc_context)  # Serve's documented way: set the code, return an empty response
            return pb.GenerateResponse()
        plan = admitted.plan
        choices, usages = [], []
        for c, r in zip(plan.choices, results, strict=True):
            detok = detokenizer(front, plan.request, c.sampling, admitted.eos)
            text = await front.detokenize(detok, list(r["token_ids"]), r["finish_reason"])
            calls, reason = [], None
            if plan.tools is not None:  # the calls read as the HTTP API reads them
                message, reason = Answer.of(plan.tools, plan.thinks).message(text, r["finish_reason"])
                calls = message.tool_calls or []
            choices.append(choice_message(c.index, r, text, calls, reason))
            usages.append(await counted_usage(front, r.get("usage") or {}, c, list(r["token_ids"])))
        usage = summed_usage(plan.choices, usages)
        return unary_response(choices, usage, front.model_name, admitted.request_id)

    async def GenerateStream(
        self, request: pb.GenerateRequest, grpc_context: StatusContext | None = None
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        backend, front = cast(Backend, self), self.front
        try:
            admitted = await _admit(backend, front, request, grpc_context)
            opened = await _refused_as_status(open_choices(backend, admitted.plan), front, admitted.prompt)
        except GrpcStatus as status:
            # A stream that yields nothing never hands Serve's proxy its context: raise after setting
            # the code, which Serve's replica carries as the status (gRPCStatusError).
            status.apply(grpc_context)
            raise
        plan, rid = admitted.plan, admitted.request_id
        detoks = {c.index: detokenizer(front, plan.request, c.sampling, admitted.eos) for c in plan.choices}
        answers = {c.index: Answer.of(plan.tools, plan.thinks) for c in plan.choices} if plan.tools is not None else {}
        outputs: dict[int, list[int]] = {}  # each choice's token ids so far (for prediction counts)
        try:
            async with contextlib.aclosing(merged_chunks(opened)) as chunks:  # closed here: before the streams
                async for choice, chunk in chunks:
                    ids, reason = list(chunk["token_ids"]), chunk["finish_reason"]
                    text = await front.detokenize(detoks[choice.index], ids, reason)
                    if choice.sampling.get("prediction"):
                        outputs.setdefault(choice.index, []).extend(ids)
                    if reason is not None:
                        used = chunk.get("usage") or {}
                        chunk = chunk | {
                            "usage": await counted_usage(front, used, choice, outputs.pop(choice.index, []))
                        }
                    deltas, told = [], None
                    if (answer := answers.get(choice.index)) is not None:  # the calls this text completes, as HTTP's
                        delta, told = answer.delta(text, reason)
                        deltas = delta.tool_calls if delta is not None and delta.tool_calls else []
                    yield stream_message(choice.index, chunk, text, rid, deltas, told)
        except StreamTimeout as e:  # the messages so far are sent: the status says why the stream ends here
            GrpcStatus(grpc.StatusCode.DEADLINE_EXCEEDED, str(e)).apply(grpc_context)
            raise
        finally:
            await close_streams([stream for _, _, stream in opened])  # a client that went away: the router cancels

    async def Health(self, request: pb.HealthRequest, grpc_context: StatusContext | None = None) -> pb.HealthResponse:
        serving, window = await _readiness(cast(Backend, self), self.front)
        status = pb.HealthResponse.SERVING_STATUS_SERVING if serving else pb.HealthResponse.SERVING_STATUS_NOT_SERVING
        return pb.HealthResponse(status=status, model=self.front.model_name, context_window=window)

    async def Check(
        self, request: health_pb2.HealthCheckRequest, grpc_context: StatusContext | None = None
    ) -> health_pb2.HealthCheckResponse:
        """grpc.health.v1: the server ("") and specserve.v1.SpecServe are SERVING while Health says so."""
        refusal = None
        if isinstance(request, Undecodable):
            details = f"the request is not a grpc.health.v1.HealthCheckRequest: {request.error}"
            refusal = GrpcStatus(grpc.StatusCode.INVALID_ARGUMENT, details)
        elif request.service not in ("", SERVICE):
            details = f"service: {request.service!r} is not served here; ask for '' (the server) or {SERVICE!r}"
            refusal = GrpcStatus(grpc.StatusCode.NOT_FOUND, details)
        if refusal is not None:
            refusal.apply(grpc_context)
            return health_pb2.HealthCheckResponse()
        serving, _ = await _readiness(cast(Backend, self), self.front)
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)


async def _readiness(backend: Backend, front: FrontDoor) -> tuple[bool, int]:
    """Whether a target replica can serve now, and the context window clients get (the front door's own while the
    target pool does not answer)."""
    window = front.served_window({})
    try:
        await asyncio.wait_for(backend.ready(), front.config.health_timeout_s)
        window = front.served_window(await asyncio.wait_for(backend.info(), front.config.health_timeout_s))
    except Exception:
        return False, window.tokens
    return True, window.tokens


async def _admit(
    backend: Backend, front: FrontDoor, request: pb.GenerateRequest, context: StatusContext | None
) -> Admitted:
    if not front.authorized(_bearer(context)):
        raise GrpcStatus(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong `authorization: Bearer <key>` metadata")
    if isinstance(request, Undecodable):  # bytes that are not a GenerateRequest (grpc_decoding.add_servicer)
        details = f"the request is not a specserve.v1.GenerateRequest: {request.error}"
        raise GrpcStatus(grpc.StatusCode.INVALID_ARGUMENT, details)
    prompt = request.WhichOneof("prompt") or "prompt"
    try:
        # Serve's gRPC proxy takes messages up to RAY_SERVE_GRPC_MAX_MESSAGE_SIZE (2 GiB by default), an
        # environment variable of every proxy process that an application's config cannot set, so the
        # limit is checked here, on the request's serialized size (computed, not serialized again).
        if (size := request.ByteSize()) > front.config.max_request_bytes:
            raise too_large(size, front.config.max_request_bytes)
        if request.model:
            front.check_model(request.model)
        rid = request_id(request, f"req-{uuid.uuid4().hex}")
        info = await backend.info()
        window, budget = front.served_window(info), info.get("kv_budget_tokens")
        plan = await front.off_loop(plan_generation, request, front, secrets.randbits(63), window, budget)
    except RequestError as e:
        raise _status(e) from None
    return Admitted(plan, rid, prompt, frozenset(int(t) for t in info.get("eos_ids", ())))


async def _refused_as_status(call: Any, front: FrontDoor, prompt: str) -> Any:
    """`call`'s result; the router's refusals (overload, bad input) as a GrpcStatus, other errors as they are."""
    try:
        return await call
    except Overloaded as e:
        # The hint is in the details too: Serve's proxy drops the trailing metadata of a stream that
        # fails before its first message.
        retry = front.config.retry_after_s
        details = f"the server is at capacity ({e}); retry after {retry} s"
        raise GrpcStatus(grpc.StatusCode.RESOURCE_EXHAUSTED, details, [("retry-after", str(retry))]) from e
    except RequestError as e:  # the router refused a choice's input (serving._admitted names the field)
        raise _status(renamed(e, prompt)) from e


def _status(error: RequestError) -> GrpcStatus:
    return GrpcStatus(_HTTP_TO_GRPC.get(error.status, grpc.StatusCode.INVALID_ARGUMENT), error.message)


def _bearer(context: StatusContext | None) -> str | None:
    if context is None:
        return None
    for key, value in context.invocation_metadata():
        if key.lower() == "authorization":
            scheme, _, token = str(value).partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None
