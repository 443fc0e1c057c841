"""A router replica removed mid-stream: every open stream completes or ends with an error event, none just stops.

- Scaled down (2 -> 1 router replicas by a redeploy): Serve drains the replica it removes for
  `graceful_shutdown_timeout_s`, which the app sets to `max_stream_s` plus a margin, and a stream
  still running at `max_stream_s` ends with a `stream_timeout` error event; so short streams
  complete with the target's tokens and long ones (far longer than Serve's default 20 s drain)
  end with that event, then `data: [DONE]`.
- Killed (`ray.kill` of the replica, as a crash or a lost node would): the router can say nothing,
  so the proxy's `deploy.front.proxy_guard.StreamGuard` (installed through Serve's
  RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH) ends each cut-off SSE body with a `stream_cut_off`
  error event and `data: [DONE]`; a gRPC stream ends with an error status from Serve's proxy.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import requests
from ray import serve
from transformers import PreTrainedModel

from deploy.app import build_app
from deploy.config import AppConfig
from deploy.front.grpc_decoding import GRPC_SERVICER_FUNCTIONS
from deploy.front.proxy_guard import PROXY_CALLBACK, PROXY_CALLBACK_ENV
from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc
from tests.actors.serve_helpers import APP, REPO, free_port, local_ray, replicas, run_app, wait_until
from tests.front_router import MODEL_NAME, save_tiny_pair
from tests.reliability.conftest import greedy_completion, kill_replica
from tests.tiny_models import reference_greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_STREAM_S = 15.0  # the drain is this plus DRAIN_MARGIN_S
LONG = 6000  # tokens: a stream that would run far past Serve's default drain
SHORT = 8  # tokens: done well within MAX_STREAM_S, even on 2 busy cores
WINDOW = 8192


class App:
    def __init__(self, target_dir: Path, target: PreTrainedModel, http: str, grpc_address: str) -> None:
        self.target_dir, self.target, self.http, self.grpc = target_dir, target, http, grpc_address

    def config(self, routers: int) -> AppConfig:
        return AppConfig.model_validate(
            {
                "target_model": str(self.target_dir),
                "drafter": {"kind": "none"},
                "dtype": "float32",
                "torch_threads": 1,
                "target_pool": {"shard_num_cpus": 0.5},
                "router_pool": {
                    "num_cpus": 0.25,
                    "router": {"max_stream_s": MAX_STREAM_S},
                    "autoscaling": {"min_replicas": routers, "max_replicas": routers},
                },
                "front_door": {"served_model_name": MODEL_NAME, "open": True, "context_window": WINDOW},
            }
        )


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    target_dir, _, target = save_tiny_pair(Path(tmp_path_factory.mktemp("drain")), positions=1 << 14)
    http_port, grpc_port = free_port(), free_port()
    # Read by each Serve proxy at its start (its process inherits this environment through the raylet).
    proxy_env = {
        PROXY_CALLBACK_ENV: PROXY_CALLBACK,
        "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
    }
    saved = {key: os.environ.get(key) for key in proxy_env}
    os.environ.update(proxy_env)
    try:
        with local_ray(num_cpus=4):
            serve.start(
                http_options={"host": "127.0.0.1", "port": http_port},
                grpc_options={"port": grpc_port, "grpc_servicer_functions": GRPC_SERVICER_FUNCTIONS},
            )
            served = App(target_dir, target, f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}")
            run_app(build_app(served.config(routers=2)), route_prefix="/")
            yield served
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def prompt_of(i: int) -> list[int]:
    return [7 + i, 8, 9 + i, 10]


def stream(app: App, i: int, max_tokens: int, started: threading.Event) -> dict[str, Any]:
    """One SSE completion, read to its end: its tokens, its finish reason, its error event, whether `[DONE]`
    came, and how the body ended if it was cut (`cut`)."""
    body = greedy_completion(prompt_of(i), max_tokens, stream=True)
    out: dict[str, Any] = {"tokens": [], "reason": None, "error": None, "done": False, "cut": None}
    try:
        with requests.post(app.http + "/v1/completions", json=body, stream=True, timeout=120) as r:
            assert r.status_code == 200, r.text
            for line in r.iter_lines():
                if line == b"data: [DONE]":
                    out["done"] = True
                elif line.startswith(b"data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        out["error"] = event["error"]
                        continue
                    choice = event["choices"][0]
                    out["tokens"] += choice.get("token_ids") or []
                    out["reason"] = out["reason"] or choice.get("finish_reason")
                    started.set()
    except requests.RequestException as e:  # the body ended without its last chunk
        out["cut"] = repr(e)
    return out


def open_streams(app: App, lengths: list[int]) -> tuple[ThreadPoolExecutor, list[Any]]:
    """Streams started, each past its first event (mid-decode), and their futures."""
    pool = ThreadPoolExecutor(len(lengths))
    started = [threading.Event() for _ in lengths]
    futures = [pool.submit(stream, app, i, n, started[i]) for i, n in enumerate(lengths)]
    assert all(e.wait(timeout=120) for e in started), "every stream is mid-decode"
    return pool, futures


def test_a_router_replica_scaled_down_mid_stream_drains_every_stream(app: App) -> None:
    lengths = [SHORT, LONG] * 4
    pool, futures = open_streams(app, lengths)
    run_app(build_app(app.config(routers=1)), route_prefix="/")  # Serve removes one router replica
    with pool:
        outcomes = [f.result(timeout=180) for f in futures]
    print([{k: (v if k != "tokens" else len(v)) for k, v in o.items()} for o in outcomes])
    assert wait_until(lambda: replicas("router", ("RUNNING",)) == 1, timeout_s=60)
    for i, (n, out) in enumerate(zip(lengths, outcomes, strict=True)):
        assert out["cut"] is None and out["done"], f"stream {i} just stopped: {out['cut']}"
        if out["error"] is None:
            assert out["reason"] == "length" and out["tokens"] == reference_greedy(app.target, prompt_of(i), n)
        else:
            assert out["error"]["code"] == "stream_timeout" and n == LONG, out["error"]
            assert 0 < len(out["tokens"]) < n
    assert any(out["error"] for out in outcomes), "the long streams outlive max_stream_s"


def grpc_stream(app: App, started: threading.Event) -> tuple[int, grpc.StatusCode | None]:
    """A long GenerateStream read to its end: tokens received and its error status (None: it ended OK)."""
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=LONG, ignore_eos=True)
    request = pb.GenerateRequest(model=MODEL_NAME, token_ids=pb.TokenIds(ids=prompt_of(9)), sampling=sampling)

    async def read() -> tuple[int, grpc.StatusCode | None]:
        tokens = 0
        async with grpc.aio.insecure_channel(app.grpc) as channel:
            try:
                async for message in pb_grpc.SpecServeStub(channel).GenerateStream(
                    request, metadata=(("application", APP),)
                ):
                    tokens += len(message.token_ids)
                    started.set()
            except grpc.aio.AioRpcError as e:
                return tokens, e.code()
        return tokens, None

    return asyncio.run(read())


def test_a_router_replica_killed_mid_stream_ends_every_stream_with_an_error_event(app: App) -> None:
    assert wait_until(lambda: replicas("router", ("RUNNING",)) == 1, timeout_s=60)
    pool, futures = open_streams(app, [LONG] * 3)
    grpc_started = threading.Event()
    with ThreadPoolExecutor(1) as grpc_pool:
        grpc_future = grpc_pool.submit(grpc_stream, app, grpc_started)
        assert grpc_started.wait(timeout=120)
        kill_replica("router")
        with pool:
            outcomes = [f.result(timeout=120) for f in futures]
        grpc_tokens, grpc_code = grpc_future.result(timeout=120)
    print([{k: (v if k != "tokens" else len(v)) for k, v in o.items()} for o in outcomes], grpc_tokens, grpc_code)
    for out in outcomes:
        assert out["cut"] is None and out["done"], f"a stream just stopped: {out['cut']}"
        assert out["error"] is not None and out["error"]["code"] == "stream_cut_off", out
        assert 0 < len(out["tokens"]) < LONG
    assert 0 < grpc_tokens < LONG and grpc_code not in (None, grpc.StatusCode.OK), grpc_code
    assert wait_until(lambda: replicas("router", ("RUNNING",)) == 1, timeout_s=120), "Serve replaced it"
