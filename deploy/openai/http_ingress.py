"""The OpenAI-compatible HTTP front door: a FastAPI app over the router's generate / generate_stream.

    POST /v1/completions        text or token-id prompts; `stream: true` for server-sent events
    POST /v1/chat/completions   messages through the model's own chat template
    GET  /v1/models             the served model; GET /v1/models/{id} its card
    POST /tokenize, /detokenize vLLM's: the token ids a prompt or conversation runs on, and back
    GET  /health                readiness: 200 while a target replica can serve, else 503 (no API key)
    GET  /docs, /openapi.json   the API's documents (behind the key, when one is set)

Errors are OpenAI's body `{"error": {"message", "type", "param", "code"}}`: 400 for every malformed
request (FastAPI's 422 included), 401 for a missing or wrong API key, 404 for an unknown model or
route, 413 for a body over `front_door.max_request_bytes`, 429 with `Retry-After` when the router
is full (`actors.router.Overloaded`).

Parsing, chat templating and tokenizing run on the front door's threads (`FrontDoor.off_loop`):
the replica's event loop also drives every lane and answers /health, and a 4 MB prompt takes
seconds to tokenize. deploy/openai/serving.py runs a completions or chat request's choices on the
router; request fields the API does not declare are ignored (named in the
`x-specserve-ignored-fields` header) or refused, as `front_door.unknown_fields` says.

Wiring (deploy/app.py): the ingress is the Router class itself with the two front-door mixins;
Serve builds this app on each replica after the constructor (`__serve_build_asgi_app__`), so the
routes call that replica's own `generate` / `generate_stream`, with no handle in between:

    from deploy.front.frontdoor import FrontDoorConfig, load_front_door
    from deploy.front.grpc_decoding import GRPC_SERVICER_FUNCTIONS
    from deploy.grpc.ingress import GrpcIngress
    from deploy.openai.http_ingress import OpenAIIngress

    class Ingress(OpenAIIngress, GrpcIngress, Router):  # the router, with both front doors
        def __init__(self, front: FrontDoorConfig, config: RouterConfig, draft: Any, target: Any, *,
                     tokenizer: str, resolve: Resolver = identity) -> None:
            Router.__init__(self, config, draft, target, tokenizer=tokenizer, resolve=resolve)
            self.front = load_front_door(front, tokenizer, resolve)

    # in build_app, instead of `serve.deployment(...)(Router)`:
    router = serve.deployment(name="router", ...)(serve.ingress()(Ingress))
    return router.bind(front_door_config, config.router(), draft, target,
                       tokenizer=config.target_model, resolve=resolver)

`serve.ingress()` with no app takes the app from `__serve_build_asgi_app__`. For gRPC, Serve's
proxy needs `grpc_options={"grpc_servicer_functions": GRPC_SERVICER_FUNCTIONS}` (`serve.start`, or
the Serve YAML's top-level `grpc_options`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.router import GenerationFailed, Overloaded
from deploy.front.frontdoor import Backend, FrontDoor, RequestError, param_path, too_large
from deploy.openai.api import ChatCompletionRequest, CompletionRequest, ErrorBody, ModelCard, ModelList
from deploy.openai.serving import serve
from deploy.openai.tokenize_api import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from deploy.openai.unknown_fields import ignored_header

logger = logging.getLogger(__name__)


class OpenAIIngress:
    """Mixin for the ingress deployment class: Serve calls this after `__init__` to build the app."""

    front: FrontDoor  # set by the combined class's constructor

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_http_app(cast(Backend, self), self.front)


def build_http_app(backend: Backend, front: FrontDoor) -> FastAPI:
    """The OpenAI-compatible app over `backend` (the router, or anything with its methods)."""
    # The API's documents are served below, behind the key like the API they describe.
    app = FastAPI(
        title="specserve",
        summary="Lossless speculative decoding, OpenAI-compatible",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    _install_error_handlers(app, front)

    def authorize(request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if not front.authorized(token.strip() if scheme.lower() == "bearer" else None):
            message = "Incorrect API key provided." if token else "Missing API key: send `Authorization: Bearer <key>`."
            raise RequestError(message, status=401, code="invalid_api_key")

    @app.get("/health")
    async def health() -> Response:
        """200 while a target replica can serve; else 503 saying why in words (the details go to the log only:
        /health needs no key, and an exception's text can name hosts, paths and actor ids)."""
        limit = front.config.health_timeout_s
        try:
            await asyncio.wait_for(backend.ready(), limit)
        except TimeoutError:
            why = f"no target replica answered within {limit:g} s"
        except Exception as e:
            logger.warning("health: the target pool cannot serve: %r", e)
            why = "no target replica can serve now (the server log has the details)"
        else:
            return JSONResponse({"status": "ok", "model": front.model_name})
        error = RequestError(f"not ready: {why}", status=503, type="server_error", code="not_ready")
        return JSONResponse(ErrorBody.of(error).model_dump(), status_code=503)

    @app.get("/openapi.json", dependencies=[Depends(authorize)], include_in_schema=False)
    async def openapi_document() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", dependencies=[Depends(authorize)], include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="specserve")

    async def card() -> ModelCard:
        window = front.served_window(await backend.info())
        return ModelCard(id=front.model_name, created=0, max_model_len=window.tokens)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> ModelList:
        return ModelList(data=[await card()])

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorize)])
    async def model(model_id: str) -> ModelCard:
        front.check_model(model_id)  # another id: 404 model_not_found, as OpenAI answers
        return await card()

    @app.post("/v1/completions", dependencies=[Depends(authorize)], openapi_extra=_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        body = await read_body(request, front.config.max_request_bytes)
        return await serve(backend, front, CompletionRequest, body)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)], openapi_extra=_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request, front.config.max_request_bytes)
        return await serve(backend, front, ChatCompletionRequest, body)

    @app.post("/tokenize", dependencies=[Depends(authorize)], openapi_extra=_body(TokenizeRequest))
    async def tokenize_route(request: Request) -> Response:
        body = await read_body(request, front.config.max_request_bytes)
        window = front.served_window(await backend.info())
        reply, ignored = await front.off_loop(tokenize, front, body, window.tokens)
        return JSONResponse(reply.model_dump(mode="json"), headers=ignored_header(ignored))

    @app.post("/detokenize", dependencies=[Depends(authorize)], openapi_extra=_body(DetokenizeRequest))
    async def detokenize_route(request: Request) -> Response:
        body = await read_body(request, front.config.max_request_bytes)
        reply, ignored = await front.off_loop(detokenize, front, body)
        return JSONResponse(reply.model_dump(mode="json"), headers=ignored_header(ignored))

    _document_bodies(app, (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest))
    return app


def _body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of a route that parses its raw body itself (parse_request names the field)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _document_bodies(app: FastAPI, models: tuple[type[BaseModel], ...]) -> None:
    """Add the request models (and the models they nest) to the OpenAPI document's components."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 RequestError as soon as it is known to be over `limit` bytes: a declared Content-Length
    over it before a byte is read, a body sent without one once what arrived passes it. The rest is never read
    (a 100 MB body costs the server `limit` bytes, not 100 MB); the connection closes after the answer."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared), limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(None, limit)
    return bytes(body)


def _install_error_handlers(app: FastAPI, front: FrontDoor) -> None:
    def body(e: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(ErrorBody.of(e).model_dump(), status_code=e.status, headers=headers)

    async def request_error(_: Request, e: Exception) -> Response:
        e = cast(RequestError, e)
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return body(e, headers)

    async def overloaded(_: Request, e: Exception) -> Response:
        error = RequestError(
            f"The server is at capacity ({e}); retry later.", status=429, type="rate_limit_exceeded", code="overloaded"
        )
        return body(error, {"Retry-After": str(front.config.retry_after_s)})

    async def validation(_: Request, e: Exception) -> Response:  # FastAPI's 422 -> OpenAI's 400
        details = cast(RequestValidationError, e).errors()
        first = details[0] if details else {"loc": (), "msg": "invalid request"}
        loc = tuple(first.get("loc", ()))
        param = param_path(loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc)
        message = str(first.get("msg", "invalid request"))
        return body(RequestError(f"{param}: {message}" if param else message, param=param))

    async def http_error(_: Request, e: Exception) -> Response:  # unknown routes and methods
        e = cast(StarletteHTTPException, e)
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return body(RequestError(str(e.detail), status=e.status_code, code=code), dict(e.headers or {}))

    async def generation_failed(_: Request, e: Exception) -> Response:  # the cause is the request's own to know
        return body(RequestError(f"generation failed: {e}", status=500, type="server_error", code="generation_failed"))

    async def internal(_: Request, e: Exception) -> Response:
        logger.exception("request failed")
        error = f"internal error ({type(e).__name__}); the server log has the details"
        return body(RequestError(error, status=500, type="server_error", code="internal_error"))

    app.add_exception_handler(RequestError, request_error)
    app.add_exception_handler(Overloaded, overloaded)
    app.add_exception_handler(GenerationFailed, generation_failed)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal)
