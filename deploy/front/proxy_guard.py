"""A middleware for Serve's HTTP proxy: an event stream cut off mid-body ends with an error event instead,
and the proxy's per-request hint headers (`PROXY_HINTS`) are not taken from clients.

When the router replica streaming a response dies (killed, its node lost, or stopped by Serve once
its `graceful_shutdown_timeout_s` ran out), Serve's proxy stops forwarding the response without
ending it, and the client sees the connection close mid-body: no error, no `data: [DONE]`. The
router cannot say anything (its process is gone), so the proxy does: `StreamGuard` watches each
`text/event-stream` response and, if the app returns or raises before the body's last message,
sends OpenAI's error event and `data: [DONE]` and ends the body.

Serve takes proxy middlewares only from the environment of each proxy's process, so a cluster turns
this on where its nodes start (the `ray start` environment; k8s/rayservice.yaml sets it):

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deploy.front.proxy_guard:middlewares

It imports nothing of the server (the proxy stays light), so the error body is written here, in
the shape of `deploy.openai.api.ErrorBody`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

# The environment variable Serve's proxies read their middlewares from, and what it names here.
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "deploy.front.proxy_guard:middlewares"

# Headers Serve's proxy reads as per-request hints from a trusted load balancer in front of it: from a client,
# `x-request-disconnect-disabled: ?1` would keep an abandoned request generating and `x-request-timeout-seconds`
# would lift the configured timeout. Dropped before the proxy reads them.
PROXY_HINTS = frozenset({b"x-request-disconnect-disabled", b"x-request-timeout-seconds"})

CUT_OFF = {
    "message": "the stream was cut off: the server replica generating it went away; retry the request",
    "type": "server_error",
    "param": None,
    "code": "stream_cut_off",
}
ENDING = f"data: {json.dumps({'error': CUT_OFF})}\n\ndata: [DONE]\n\n".encode()


class StreamGuard:
    """Ends a `text/event-stream` response that its app left unfinished with an error event and `[DONE]`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers", []) if k.lower() not in PROXY_HINTS]}
        state = {"events": False, "ended": False}

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or [])
                state["events"] = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["ended"] = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            if not state["events"] or state["ended"]:
                raise
            logger.exception("an event stream failed mid-body")
        if state["events"] and not state["ended"]:
            await _end(send)


async def _end(send: Send) -> None:
    try:
        await send({"type": "http.response.body", "body": ENDING, "more_body": False})
    except Exception as e:  # the client is gone too: nothing left to tell
        logger.info("could not end a cut-off event stream: %r", e)


def middlewares() -> list[Any]:
    """What RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH names: Serve calls it in each proxy at start."""
    return [Middleware(StreamGuard)]
