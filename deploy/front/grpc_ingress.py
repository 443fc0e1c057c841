"""The gRPC front door: `specserve.v1.SpecServe` (proto/specserve.proto) over the router.

Serve's gRPC proxy (`grpc_options.grpc_servicer_functions = GRPC_SERVICER_FUNCTIONS`) calls the
ingress deployment's methods named like the RPCs with the request proto, passing its
`RayServegRPCContext` as `grpc_context`; a unary method returns the response, a streaming one yields
them. `GrpcIngress` is those methods, a mixin for the Router class (see deploy/openai/http_ingress.py for
the wiring). Errors are status codes with details naming the field:

    INVALID_ARGUMENT    bad input ("sampling.top_p: ...", "text: must not be empty")
    NOT_FOUND           an unknown `model`
    UNAUTHENTICATED     an API key is configured and `authorization: Bearer <key>` is missing/wrong
    RESOURCE_EXHAUSTED  the router is full (actors.router.Overloaded); trailing `retry-after` seconds
                        (and "retry after N s" in the details, which survive Serve's proxy on streams);
                        or the request is over `front_door.max_request_bytes` serialized
    DEADLINE_EXCEEDED   a stream ran past `router_pool.router.max_stream_s` (after the messages sent so far)

Tokenizing runs on the front door's threads (`FrontDoor.off_loop`), as on HTTP.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, cast

import grpc

from actors.admission import ContextWindow
from actors.router import Overloaded, StreamTimeout
from deploy.front.frontdoor import (
    Backend,
    Detokenizer,
    FrontDoor,
    RequestError,
    check_stops,
    client_error,
    fit_context,
    sampling_params,
    too_large,
)
from deploy.front.grpc_decoding import SERVICER_FUNCTION, Undecodable
from proto import specserve_pb2 as pb

GRPC_SERVICER_FUNCTIONS = [SERVICER_FUNCTION]  # requests decoded without raising (grpc_decoding.py)

_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}
_HTTP_TO_GRPC = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
_OPTIONAL_SAMPLING = ("temperature", "top_k", "top_p", "repetition_penalty", "ignore_eos", "max_draft_tokens")


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


class GrpcIngress:
    """Mixin for the ingress deployment class: the RPCs of specserve.v1.SpecServe."""

    front: FrontDoor  # set by the combined class's constructor

    async def Generate(
        self, request: pb.GenerateRequest, grpc_context: StatusContext | None = None
    ) -> pb.GenerateResponse:
        backend, front = cast(Backend, self), self.front
        try:
            ids, sampling = await _admit(backend, front, request, grpc_context)
            try:
                result = await backend.generate(ids, sampling)
            except Exception as e:
                if (refusal := _refusal(e, front, request)) is None:
                    raise  # a failure, not a refusal: INTERNAL
                raise refusal from e
        except GrpcStatus as status:
            status.apply(grpc_context)  # Serve's documented way: set the code, return an empty response
            return pb.GenerateResponse()
        detok = Detokenizer(front.decode, tuple(sampling["stop"]))
        return pb.GenerateResponse(
            token_ids=result["token_ids"],
            text=await front.detokenize(detok, list(result["token_ids"]), result["finish_reason"]),
            finish_reason=_FINISH.get(result["finish_reason"] or "", pb.FINISH_REASON_UNSPECIFIED),
            usage=_usage(result.get("usage") or {}),
            model=front.model_name,
        )

    async def GenerateStream(
        self, request: pb.GenerateRequest, grpc_context: StatusContext | None = None
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        backend, front = cast(Backend, self), self.front
        try:
            ids, sampling = await _admit(backend, front, request, grpc_context)
            stream = backend.generate_stream(ids, sampling)
            try:
                first = await anext(stream)
            except Exception as e:
                if (refusal := _refusal(e, front, request)) is None:
                    raise
                raise refusal from e
        except GrpcStatus as status:
            # A stream that yields nothing never hands Serve's proxy its context: raise after setting
            # the code, which Serve's replica carries as the status (gRPCStatusError).
            status.apply(grpc_context)
            raise
        detok = Detokenizer(front.decode, tuple(sampling["stop"]))
        try:
            chunk = first
            while True:
                reason = chunk["finish_reason"]
                message = pb.GenerateStreamResponse(
                    token_ids=chunk["token_ids"],
                    text=await front.detokenize(detok, list(chunk["token_ids"]), reason),
                    finish_reason=_FINISH.get(reason or "", pb.FINISH_REASON_UNSPECIFIED),
                )
                if reason is not None:
                    message.usage.CopyFrom(_usage(chunk.get("usage") or {}))
                yield message
                if reason is not None:
                    return
                chunk = await anext(stream)
        except StreamTimeout as e:  # the messages so far are sent: the status says why the stream ends here
            GrpcStatus(grpc.StatusCode.DEADLINE_EXCEEDED, str(e)).apply(grpc_context)
            raise
        finally:
            await cast(Any, stream).aclose()  # a client that went away: the router cancels the sequence

    async def Health(self, request: pb.HealthRequest, grpc_context: StatusContext | None = None) -> pb.HealthResponse:
        backend, front = cast(Backend, self), self.front
        window = front.served_window({})  # while the target pool does not answer: the front door's own
        try:
            await asyncio.wait_for(backend.ready(), front.config.health_timeout_s)
            window = front.served_window(await asyncio.wait_for(backend.info(), front.config.health_timeout_s))
            status = pb.HealthResponse.SERVING_STATUS_SERVING
        except Exception:
            status = pb.HealthResponse.SERVING_STATUS_NOT_SERVING
        return pb.HealthResponse(status=status, model=front.model_name, context_window=window.tokens)


async def _admit(
    backend: Backend, front: FrontDoor, request: pb.GenerateRequest, context: StatusContext | None
) -> tuple[list[int], dict[str, Any]]:
    if not front.authorized(_bearer(context)):
        raise GrpcStatus(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong `authorization: Bearer <key>` metadata")
    if isinstance(request, Undecodable):  # bytes that are not a GenerateRequest (grpc_decoding.add_servicer)
        details = f"the request is not a specserve.v1.GenerateRequest: {request.error}"
        raise GrpcStatus(grpc.StatusCode.INVALID_ARGUMENT, details)
    try:
        # Serve's gRPC proxy takes messages up to RAY_SERVE_GRPC_MAX_MESSAGE_SIZE (2 GiB by default), an
        # environment variable of every proxy process that an application's config cannot set, so the
        # limit is checked here, on the request's serialized size (computed, not serialized again).
        if (size := request.ByteSize()) > front.config.max_request_bytes:
            raise too_large(size, front.config.max_request_bytes)
        if request.model:
            front.check_model(request.model)
        window = front.served_window(await backend.info())
        return await front.off_loop(proto_to_generation, request, front, secrets.randbits(63), window)
    except RequestError as e:
        raise GrpcStatus(_HTTP_TO_GRPC.get(e.status, grpc.StatusCode.INVALID_ARGUMENT), e.message) from None


def proto_to_generation(
    request: pb.GenerateRequest, front: FrontDoor, seed: int, window: ContextWindow | None = None
) -> tuple[list[int], dict[str, Any]]:
    """Prompt token ids and the SamplingParams dict of a GenerateRequest (as `openai_api.openai_to_generation`
    gives them for HTTP); RequestError names the field.

    `window`: what the deployment serves (`FrontDoor.served_window`); None: the front door's own.

    Tokenizes (control-token text in `text` as plain text): run it off the event loop.
    """
    which = request.WhichOneof("prompt")
    if which is None:
        raise RequestError("prompt: set `text` or `token_ids`", param="prompt")
    s = request.sampling
    check_stops(s.stop, s.stop_token_ids, "sampling.")  # the HTTP front door's bounds, before tokenizing
    ids = front.prompts.text(request.text) if which == "text" else list(request.token_ids.ids)
    if not ids:
        raise RequestError(f"{which}: must not be empty", param=which)
    asked = s.max_tokens if s.HasField("max_tokens") else None
    window = window or front.served_window({})
    fields: dict[str, Any] = {name: getattr(s, name) for name in _OPTIONAL_SAMPLING if s.HasField(name)}
    fields |= {
        "max_tokens": fit_context(len(ids), asked, None, window, which, "sampling.max_tokens"),
        "stop": tuple(s.stop),
        "stop_token_ids": tuple(s.stop_token_ids),
        "seed": s.seed if s.HasField("seed") else seed,
    }
    return ids, sampling_params(fields, ("sampling",))


def _refusal(e: Exception, front: FrontDoor, request: pb.GenerateRequest) -> GrpcStatus | None:
    """The router's refusals (overload, bad input) as statuses; None for any other error."""
    if isinstance(e, Overloaded):
        # The hint is in the details too: Serve's proxy drops the trailing metadata of a stream that
        # fails before its first message.
        retry = front.config.retry_after_s
        return GrpcStatus(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the server is at capacity ({e}); retry after {retry} s",
            [("retry-after", str(retry))],
        )
    error = client_error(e, request.WhichOneof("prompt") or "prompt", "sampling.")
    return GrpcStatus(grpc.StatusCode.INVALID_ARGUMENT, error.message) if error is not None else None


def _bearer(context: StatusContext | None) -> str | None:
    if context is None:
        return None
    for key, value in context.invocation_metadata():
        if key.lower() == "authorization":
            scheme, _, token = str(value).partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def _usage(usage: dict[str, Any]) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        draft_tokens=int(usage.get("drafted", 0)),
        accepted_tokens=int(usage.get("accepted", 0)),
        acceptance_length=float(usage.get("acceptance_length", 0.0)),
    )
