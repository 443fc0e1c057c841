"""Secure defaults of the HTTP front door (issue 50): the API's documents behind the key, /health saying why in
words without internals, a body cut off at the cap (bytes read counted), the key from the environment, the
proxy's per-request hint headers not taken from clients, and local.yaml's HTTP on loopback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from fastapi.testclient import TestClient
from pydantic import ValidationError
from starlette.types import Message, Receive, Scope, Send

from deploy.front import exposure
from deploy.front.frontdoor import FrontDoorConfig, load_front_door
from deploy.front.proxy_guard import StreamGuard
from tests.front_router import (
    MODEL_NAME,
    TinyIngress,
    front_door,
    save_tiny_pair,
    serve_in_thread,
    tiny_pair,
    tiny_tokenizer,
)

KEY = "sk-test-key"
MiB = 1024 * 1024
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.fixture(scope="module")
def keyed(pair) -> TinyIngress:
    return TinyIngress(front_door(tiny_tokenizer(), 64, api_key=KEY), *pair)


def test_the_api_documents_need_the_key_when_one_is_set(keyed: TinyIngress, pair) -> None:
    with TestClient(keyed.__serve_build_asgi_app__()) as client:
        for path in ("/docs", "/openapi.json"):
            assert client.get(path).status_code == 401, path
            assert client.get(path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200, path
        schema = client.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert "/v1/chat/completions" in schema["paths"] and "CompletionRequest" in schema["components"]["schemas"]
        assert client.get("/redoc").status_code == 404
    open_door = TinyIngress(front_door(tiny_tokenizer(), 64), *pair)
    with TestClient(open_door.__serve_build_asgi_app__()) as client:
        assert client.get("/docs").status_code == 200 and client.get("/openapi.json").status_code == 200


class Failing(TinyIngress):
    """An ingress whose target pool fails its readiness check with an error naming internals."""

    fault: BaseException = RuntimeError("ActorDiedError: actor 9f3c at 10.1.2.3:6379 /home/ray/session_2026")

    async def ready(self) -> None:
        raise self.fault


def test_health_says_why_in_words_without_internals(pair) -> None:
    ingress = Failing(front_door(tiny_tokenizer(), 64, health_timeout_s=0.5), *pair)
    with TestClient(ingress.__serve_build_asgi_app__()) as client:
        reply = client.get("/health")
        assert reply.status_code == 503
        message = reply.json()["error"]["message"]
        assert message == "not ready: no target replica can serve now (the server log has the details)"
        assert "10.1.2.3" not in reply.text and "ActorDiedError" not in reply.text
        ingress.fault = TimeoutError()
        assert client.get("/health").json()["error"]["message"] == "not ready: no target replica answered within 0.5 s"


class CountingReads:
    """ASGI middleware counting the request body bytes the app reads."""

    def __init__(self, app: Any) -> None:
        self.app, self.read = app, 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def counted() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                self.read += len(message.get("body", b""))
            return message

        await self.app(scope, counted, send)


@pytest.fixture(scope="module")
def counted(pair) -> Iterator[tuple[str, CountingReads]]:
    app = CountingReads(TinyIngress(front_door(tiny_tokenizer(), 64), *pair).__serve_build_asgi_app__())
    with serve_in_thread(app) as url:
        yield url, app


@pytest.mark.parametrize("declared", [True, False])
def test_a_100mb_body_is_cut_off_at_the_cap(counted: tuple[str, CountingReads], declared: bool) -> None:
    """Declared (Content-Length): refused before a byte is read; sent in chunks: read up to the cap, no further.
    The client gets the 413, or a closed connection where it was still sending (the server stopped reading)."""
    url, app = counted
    app.read = 0
    head = json.dumps({"model": MODEL_NAME, "prompt": ""})[:-2].encode()  # '{"model": ..., "prompt": '
    chunks = (head if i == 0 else b"x" * MiB for i in range(100))
    body: Any = b"".join(chunks) if declared else chunks
    try:
        reply = requests.post(f"{url}/v1/completions", data=body, timeout=60)
        assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
    except requests.ConnectionError:
        pass  # the server closed the connection mid-upload after answering
    assert app.read <= (0 if declared else 8 * MiB + MiB), app.read
    ok = requests.post(
        f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}, timeout=60
    )
    assert ok.status_code == 200


def test_the_key_comes_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target, _, _ = save_tiny_pair(tmp_path)
    config = FrontDoorConfig(served_model_name=MODEL_NAME, api_key_env="SPECSERVE_TEST_KEY")
    monkeypatch.delenv("SPECSERVE_TEST_KEY", raising=False)
    with pytest.raises(ValueError, match="SPECSERVE_TEST_KEY is unset or empty"):
        load_front_door(config, str(target))
    monkeypatch.setenv("SPECSERVE_TEST_KEY", KEY)
    front = load_front_door(config, str(target))
    assert front.authorized(KEY) and not front.authorized("sk-other") and not front.authorized(None)
    with pytest.raises(ValidationError, match="keep one"):
        FrontDoorConfig(served_model_name=MODEL_NAME, api_key=KEY, api_key_env="SPECSERVE_TEST_KEY")


def test_the_proxys_hint_headers_are_not_taken_from_clients() -> None:
    """`x-request-disconnect-disabled: ?1` would keep an abandoned request generating; the proxy's middleware
    drops it (and `x-request-timeout-seconds`) before Serve's proxy reads the request."""
    seen: dict[bytes, bytes] = {}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.update(dict(scope["headers"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    hints = {"x-request-disconnect-disabled": "?1", "x-request-timeout-seconds": "99999", "x-kept": "1"}
    TestClient(StreamGuard(app)).get("/v1/models", headers=hints)  # no `with`: no lifespan messages
    assert b"x-kept" in seen
    assert b"x-request-disconnect-disabled" not in seen and b"x-request-timeout-seconds" not in seen


@pytest.mark.parametrize("name", ["local.yaml", "smoke.yaml", "cluster.yaml", "cluster-gpu.yaml"])
def test_every_shipped_yaml_binds_loopback_or_requires_a_key(name: str) -> None:
    """local.yaml and smoke.yaml (one machine): HTTP on loopback, no gRPC (Serve's gRPC proxy binds every
    interface); the cluster YAMLs, reachable from other machines, read their key from the environment."""
    import yaml

    shipped = yaml.safe_load((REPO / "deploy" / name).read_text())
    front = FrontDoorConfig.model_validate(shipped["applications"][0]["args"]["front_door"])
    why = exposure.reachable(
        (shipped.get("http_options") or {}).get("host"),
        (shipped.get("grpc_options") or {}).get("grpc_servicer_functions", []),
    )
    exposure.check(front, why)  # the shipped configs start
    assert not front.open
    if name in ("local.yaml", "smoke.yaml"):
        assert shipped["http_options"]["host"] == "127.0.0.1" and not why
    else:
        assert why and front.api_key_env == "SPECSERVE_API_KEY"


def test_a_server_other_machines_reach_without_a_key_refuses_to_start() -> None:
    """An HTTP bind beyond loopback, or gRPC at all, needs a key, or `open: true` said on purpose."""
    assert exposure.reachable("127.0.0.1", []) == [] and exposure.reachable("::1", []) == []
    assert exposure.reachable("localhost", []) == []
    why = exposure.reachable("0.0.0.0", ["deploy.front.grpc_decoding.add_servicer"])
    assert len(why) == 2 and "0.0.0.0" in why[0] and "gRPC" in why[1]
    assert exposure.reachable("specserve.internal", []), "a name may resolve anywhere"
    bare = FrontDoorConfig(served_model_name=MODEL_NAME)
    with pytest.raises(ValueError, match=r"refusing to serve without an API key .*HTTP listens on 0\.0\.0\.0"):
        exposure.check(bare, why)
    exposure.check(bare, [])  # loopback: no key needed
    exposure.check(FrontDoorConfig(served_model_name=MODEL_NAME, api_key_env="SPECSERVE_API_KEY"), why)
    exposure.check(FrontDoorConfig(served_model_name=MODEL_NAME, open=True), why)
    import ray

    if not ray.is_initialized():  # building an app with no Ray up reads no binds, and starts no Ray
        assert exposure.running_serve() == [] and not ray.is_initialized()
