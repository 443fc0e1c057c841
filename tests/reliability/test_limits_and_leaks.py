"""The deployed app through Serve's HTTP and gRPC proxies under overload, disconnects and many requests.

- Overload: beyond `max_active_sequences` a request gets HTTP 429 with `Retry-After` / gRPC
  RESOURCE_EXHAUSTED with a `retry-after` trailer, at once; every admitted request completes with
  the target's own tokens, in bounded time.
- Cancellation: a client that drops its HTTP stream (or cancels its gRPC stream) mid-decode frees
  the sequence on the router, its caches on the draft and target replicas and its KV reservation
  on the target replica, as the replicas' own `describe()` accounting shows.
- No leaks: after 1,000 short requests the cached-sequence counts and the KV reservations are back to zero and the
  resident memory of every replica process is back near its level before them.
- Size: a 10 MB request gets HTTP 413 / gRPC RESOURCE_EXHAUSTED through Serve's proxies, and the
  next request is served.
- Truthful health: a target shard SIGKILLed while idle turns GET /health to 503 and gRPC Health to
  NOT_SERVING at once; requests are served again, and health is back, once Serve replaced the
  replica (last: it replaces a replica the tests above measure).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import requests
from ray import serve
from ray.serve.handle import DeploymentHandle
from transformers import PreTrainedModel

from deploy.app import build_app
from deploy.config import AppConfig
from deploy.front.grpc_decoding import GRPC_SERVICER_FUNCTIONS
from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc
from tests.actors.serve_helpers import APP, free_port, local_ray, run_app, wait_until
from tests.front_router import MODEL_NAME, save_tiny_pair
from tests.reliability.conftest import actor_rss, describe, greedy_completion, target_shard_killer
from tests.tiny_models import reference_greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_ACTIVE = 6
RETRY_AFTER = 3
METADATA = (("application", APP),)


class Served:
    def __init__(self, handle: DeploymentHandle, http: str, grpc_address: str, target: PreTrainedModel) -> None:
        self.handle, self.http, self.grpc, self.target = handle, http, grpc_address, target

    def held(self) -> tuple[int, int, int, int]:
        """Sequences the router holds, those cached on the draft and the target replica, and those holding a KV
        reservation on the target replica."""
        target = describe("target")
        return (
            self.handle.stats.remote().result()["active"],
            describe("draft")["sequences"],
            target["sequences"],
            target["kv_reserved_sequences"],
        )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    target_dir, draft_dir, target = save_tiny_pair(Path(tmp_path_factory.mktemp("limits")))
    config = AppConfig.model_validate(
        {
            "target_model": str(target_dir),
            "draft_model": str(draft_dir),
            "dtype": "float32",
            "torch_threads": 1,
            "draft_pool": {"num_cpus": 0.5},
            "target_pool": {"shard_num_cpus": 0.5},
            "router_pool": {"num_cpus": 0.25, "router": {"max_active_sequences": MAX_ACTIVE}},
            "front_door": {"served_model_name": MODEL_NAME, "open": True, "retry_after_s": RETRY_AFTER},
        }
    )
    http_port, grpc_port = free_port(), free_port()
    with local_ray(num_cpus=4):
        serve.start(
            http_options={"host": "127.0.0.1", "port": http_port},
            grpc_options={"port": grpc_port, "grpc_servicer_functions": GRPC_SERVICER_FUNCTIONS},
        )
        handle = run_app(build_app(config), route_prefix="/")
        yield Served(handle, f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", target)


def prompt_of(i: int) -> list[int]:
    return [7 + i % 50, 8 + i % 40, 9, 10 + i % 30]


def completion(served: Served, i: int, max_tokens: int) -> tuple[int, float, dict[str, Any], dict[str, str]]:
    start = time.monotonic()
    r = requests.post(served.http + "/v1/completions", json=greedy_completion(prompt_of(i), max_tokens), timeout=120)
    return r.status_code, time.monotonic() - start, r.json(), dict(r.headers)


def test_http_overload_gets_429_with_retry_after(served: Served) -> None:
    n, max_tokens = 4 * MAX_ACTIVE, 24
    _, solo, _, _ = completion(served, 0, max_tokens)
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda i: completion(served, i, max_tokens), range(n)))
    admitted = [(i, r) for i, r in enumerate(results) if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    print(f"solo {solo:.2f}s; admitted {len(admitted)}, refused {len(refused)}")
    print(f"admitted latency max {max(r[1] for _, r in admitted):.2f}s; refusal max {max(r[1] for r in refused):.2f}s")
    assert len(admitted) + len(refused) == n, [r[0] for r in results]
    assert len(admitted) >= MAX_ACTIVE and refused
    for r in refused:
        assert r[3]["retry-after"] == str(RETRY_AFTER) and r[2]["error"]["code"] == "overloaded"
        assert r[1] < 10.0, "a refusal is immediate, not a wait in a queue"
    for i, (_, latency, body, _) in admitted:
        assert body["choices"][0]["token_ids"] == reference_greedy(served.target, prompt_of(i), max_tokens)
        assert latency < 10 * solo + 20.0, "at most MAX_ACTIVE sequences share the pools: bounded latency"


def test_grpc_overload_gets_resource_exhausted_with_retry_after(served: Served) -> None:
    def request(i: int) -> pb.GenerateRequest:
        sampling = pb.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        return pb.GenerateRequest(model=MODEL_NAME, token_ids=pb.TokenIds(ids=prompt_of(i)), sampling=sampling)

    async def one(stub: pb_grpc.SpecServeStub, i: int) -> tuple[int, Any]:
        try:
            if i % 2:
                return i, [t async for m in stub.GenerateStream(request(i), metadata=METADATA) for t in m.token_ids]
            return i, list((await stub.Generate(request(i), metadata=METADATA)).token_ids)
        except grpc.aio.AioRpcError as e:
            return i, e

    async def burst() -> list[tuple[int, Any]]:
        async with grpc.aio.insecure_channel(served.grpc) as channel:
            stub = pb_grpc.SpecServeStub(channel)
            return list(await asyncio.gather(*[one(stub, i) for i in range(4 * MAX_ACTIVE)]))

    results = asyncio.run(burst())
    refused = [(i, r) for i, r in results if isinstance(r, grpc.aio.AioRpcError)]
    admitted = [(i, r) for i, r in results if not isinstance(r, grpc.aio.AioRpcError)]
    print(f"admitted {len(admitted)}, refused {len(refused)} (streams: {sum(i % 2 for i, _ in refused)})")
    assert len(admitted) >= MAX_ACTIVE and refused
    for i, error in refused:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
        assert f"retry after {RETRY_AFTER} s" in (error.details() or "")
        if i % 2 == 0:  # unary; Serve's proxy drops a failed stream's trailers, so streams get the details only
            assert ("retry-after", str(RETRY_AFTER)) in tuple(error.trailing_metadata() or ()), error
    for i, tokens in admitted:
        assert tokens == reference_greedy(served.target, prompt_of(i), 24)


def test_http_client_disconnect_frees_every_cache(served: Served) -> None:
    body = {"model": MODEL_NAME, "prompt": prompt_of(1), "max_tokens": 900, "ignore_eos": True, "stream": True}
    with requests.post(served.http + "/v1/completions", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200
        events = (line for line in r.iter_lines() if line.startswith(b"data: "))
        assert "choices" in json.loads(next(events)[6:])
        held_mid_stream = served.held()
    # the connection is closed: the client went away mid-stream
    assert held_mid_stream == (1, 1, 1, 1), "the live sequence is held by the router, the draft and the target"
    assert wait_until(lambda: served.held() == (0, 0, 0, 0), timeout_s=30), served.held()


def test_grpc_client_cancel_frees_every_cache(served: Served) -> None:
    sampling = pb.SamplingParams(max_tokens=900, ignore_eos=True)
    request = pb.GenerateRequest(model=MODEL_NAME, token_ids=pb.TokenIds(ids=prompt_of(2)), sampling=sampling)

    async def cancel_mid_stream() -> tuple[int, int, int, int]:
        async with grpc.aio.insecure_channel(served.grpc) as channel:
            call = pb_grpc.SpecServeStub(channel).GenerateStream(request, metadata=METADATA)
            await call.read()
            held = await asyncio.to_thread(served.held)
            call.cancel()
            return held

    assert asyncio.run(cancel_mid_stream()) == (1, 1, 1, 1)
    assert wait_until(lambda: served.held() == (0, 0, 0, 0), timeout_s=30), served.held()


def test_no_leaks_after_1000_short_requests(served: Served) -> None:
    async def run(n: int, concurrency: int) -> list[dict]:
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> dict:
            async with gate:
                sampling = {"temperature": 0.0 if i % 2 else 0.8, "seed": i, "max_tokens": 2 + i % 3}
                return dict(await served.handle.generate.remote(prompt_of(i), sampling))

        return list(await asyncio.gather(*[one(i) for i in range(n)]))

    asyncio.run(run(100, MAX_ACTIVE))  # warm up: allocator pools, lanes, compiled paths
    assert wait_until(lambda: served.held() == (0, 0, 0, 0), timeout_s=30)
    before = actor_rss()
    start = time.monotonic()
    results = asyncio.run(run(1000, MAX_ACTIVE))
    elapsed = time.monotonic() - start
    assert all(r["finish_reason"] == "length" and len(r["token_ids"]) == 2 + i % 3 for i, r in enumerate(results))
    assert wait_until(lambda: served.held() == (0, 0, 0, 0), timeout_s=30), served.held()
    assert served.handle.stats.remote().result()["lanes"] == 0
    after = actor_rss()
    growth = {k: (after.get(k, 0) - v) / 2**20 for k, v in before.items()}
    print(f"1000 requests in {elapsed:.1f}s; RSS growth (MiB) by process: {growth}")
    assert set(after) == set(before), "no replica died or was added"
    assert all(g < 16 for g in growth.values()), growth


def test_a_10mb_request_is_refused_through_serves_proxies(served: Served) -> None:
    text = "hello " * (10 * 2**20 // 6)
    body = {"model": MODEL_NAME, "prompt": text, "max_tokens": 2}
    http = requests.post(served.http + "/v1/completions", json=body, timeout=120)
    assert http.status_code == 413, http.text[:300]
    assert http.json()["error"]["code"] == "request_too_large"
    big = pb.GenerateRequest(model=MODEL_NAME, text=text, sampling=pb.SamplingParams(max_tokens=2))
    small = pb.GenerateRequest(model=MODEL_NAME, text="hello world", sampling=pb.SamplingParams(max_tokens=2))

    async def calls() -> tuple[grpc.aio.AioRpcError, Any]:
        options = [("grpc.max_send_message_length", 64 * 2**20)]
        async with grpc.aio.insecure_channel(served.grpc, options=options) as channel:
            stub = pb_grpc.SpecServeStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(big, metadata=METADATA)
            return refused.value, await stub.Generate(small, metadata=METADATA)

    error, after = asyncio.run(calls())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_request_bytes" in (error.details() or "")
    assert len(after.token_ids) == 2
    status, _, reply, _ = completion(served, 0, 4)
    assert status == 200 and reply["choices"][0]["token_ids"] == reference_greedy(served.target, prompt_of(0), 4)


def health(served: Served) -> tuple[int, int]:
    """GET /health's status code and gRPC Health's serving status."""

    async def grpc_health() -> int:
        async with grpc.aio.insecure_channel(served.grpc) as channel:
            reply = await pb_grpc.SpecServeStub(channel).Health(pb.HealthRequest(), metadata=METADATA, timeout=30)
            return int(reply.status)

    return requests.get(served.http + "/health", timeout=30).status_code, asyncio.run(grpc_health())


def test_health_is_503_while_the_target_lost_a_shard_and_requests_are_served_again(served: Served) -> None:
    serving, not_serving = (
        (200, pb.HealthResponse.SERVING_STATUS_SERVING),
        (503, pb.HealthResponse.SERVING_STATUS_NOT_SERVING),
    )
    assert health(served) == serving
    killed, kill = target_shard_killer()
    kill()  # no request in flight: only a health check can notice
    start = time.monotonic()
    assert wait_until(lambda: health(served) == not_serving, timeout_s=10, every_s=0.2), health(served)
    print(f"/health 503 and NOT_SERVING {time.monotonic() - start:.1f} s after the kill")
    served_again = None
    while served_again is None and time.monotonic() - start < 60:
        status, _, reply, _ = completion(served, 3, 4)
        served_again = reply if status == 200 else None
    print(f"served again {time.monotonic() - start:.1f} s after the kill")
    assert served_again is not None, "a request is served within 60 s of the kill"
    assert served_again["choices"][0]["token_ids"] == reference_greedy(served.target, prompt_of(3), 4)
    assert describe("target")["replica"] != killed, "Serve replaced the replica"
    assert wait_until(lambda: health(served) == serving, timeout_s=30), health(served)
