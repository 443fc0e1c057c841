"""`deploy.front.proxy_guard.StreamGuard` over plain ASGI apps: a cut-off event stream ends with an error event and
`[DONE]`; finished streams and other responses pass untouched. (Through Serve's proxy, with a router replica
killed mid-stream: tests/reliability/test_router_drain.py.)"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from deploy.front.proxy_guard import StreamGuard, middlewares

SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]


def app_sending(messages: list[dict[str, Any]], then_raise: bool = False) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        for message in messages:
            await send(message)
        if then_raise:
            raise RuntimeError("the replica died")

    return app


def run(app: Any) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    asyncio.run(StreamGuard(app)({"type": "http"}, receive, send))
    return sent


START = {"type": "http.response.start", "status": 200, "headers": SSE}
EVENT = {"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True}


@pytest.mark.parametrize("then_raise", [False, True], ids=["returned", "raised"])
def test_a_cut_off_event_stream_ends_with_an_error_event_and_done(then_raise: bool) -> None:
    sent = run(app_sending([START, EVENT], then_raise))
    assert sent[:2] == [START, EVENT]
    (last,) = sent[2:]
    assert last["type"] == "http.response.body" and not last["more_body"]
    error, done = last["body"].decode().strip().split("\n\n")
    assert json.loads(error.removeprefix("data: "))["error"]["code"] == "stream_cut_off"
    assert done == "data: [DONE]"


def test_a_finished_stream_and_other_responses_pass_untouched() -> None:
    end = {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
    assert run(app_sending([START, EVENT, end])) == [START, EVENT, end]
    json_start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    assert run(app_sending([json_start, EVENT])) == [json_start, EVENT]  # not an event stream: not ours to end
    with pytest.raises(RuntimeError):
        run(app_sending([], then_raise=True))  # nothing sent yet: Serve's proxy answers the error itself


def test_serve_gets_one_starlette_middleware() -> None:
    (middleware,) = middlewares()
    assert middleware.cls is StreamGuard
