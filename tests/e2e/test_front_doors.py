"""The deployed application through Serve's own HTTP and gRPC proxies, as a client meets it.

Local Ray (CPU), a tiny Llama target with a real tokenizer and a noisy-copy draft, the router as
the ingress with both front doors: the official `openai` client (completions and chat, streaming
and not) and a grpcio client generated from proto/ (unary and streaming) get the target's own
greedy tokens; malformed requests get 400 / INVALID_ARGUMENT naming the field, and the server
answers a valid request afterwards. Beside SpecServe, Serve's gRPC proxy serves grpc.health.v1's Check
(as grpc_health_probe asks it) and server reflection; a chat request with n choices, log probabilities and
sampling gets the HTTP API's tokens through both proxies.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import torch
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from ray import serve

from deploy.app import build_app
from deploy.config import AppConfig
from deploy.front.grpc_decoding import GRPC_SERVICER_FUNCTIONS
from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc
from tests.actors.serve_helpers import free_port, local_ray, merged, run_app, small_cpu_args
from tests.front_router import MODEL_NAME, save_tiny_pair, tiny_tokenizer
from tests.tiny_models import VOCAB

pytestmark = pytest.mark.slow
MAX_NEW = 12


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("e2e")
    target, draft, _ = save_tiny_pair(root)
    # The tiny draft costs as much as the tiny target, so the load control would (rightly) stop
    # drafting, and the speculative metrics below would stay at zero.
    # per-request stats on, to compare with the Prometheus counters
    overrides = {"speculation": {"load_adaptive": False}, "front_door": {"per_request_spec_decode_metrics": True}}
    args = merged(small_cpu_args(target, draft, MODEL_NAME), overrides)
    config = AppConfig.model_validate(args)
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    with local_ray(num_cpus=4, _metrics_export_port=metrics_port):
        serve.start(
            http_options={"host": "127.0.0.1", "port": http_port},
            grpc_options={"port": grpc_port, "grpc_servicer_functions": GRPC_SERVICER_FUNCTIONS},
        )
        run_app(build_app(config), route_prefix="/")
        yield {
            "http": f"http://127.0.0.1:{http_port}",
            "grpc": f"127.0.0.1:{grpc_port}",
            "metrics": f"http://127.0.0.1:{metrics_port}/metrics",
            "root": root,
        }


def reference(root: Path, prompt: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(root / "target", dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW)
    return out[0, len(prompt) :].tolist()


def client(served: dict) -> openai.OpenAI:
    return openai.OpenAI(base_url=served["http"] + "/v1", api_key="unused", max_retries=0)


GREEDY = {"temperature": 0.0, "max_tokens": MAX_NEW, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


def test_completions_with_the_openai_client_equal_the_target(served: dict) -> None:
    prompt = [7, 8, 9, 10, 11, 7, 8]
    expected = reference(served["root"], prompt)
    done = client(served).completions.create(model=MODEL_NAME, prompt=prompt, **GREEDY)
    assert done.choices[0].model_extra["token_ids"] == expected
    assert done.usage.completion_tokens == MAX_NEW
    assert done.usage.model_extra["draft_tokens"] > 0
    chunks = list(client(served).completions.create(model=MODEL_NAME, prompt=prompt, stream=True, **GREEDY))
    streamed = [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [] if c.choices else [])]
    assert streamed == expected
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text


def test_chat_with_the_openai_client_equals_the_target(served: dict) -> None:
    messages = [{"role": "user", "content": "the cat sat on the mat"}]
    tokenizer = tiny_tokenizer()
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = reference(served["root"], list(tokenizer.encode(str(rendered), add_special_tokens=False)))
    done = client(served).chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
    assert done.choices[0].model_extra["token_ids"] == expected
    text = done.choices[0].message.content
    stream = client(served).chat.completions.create(model=MODEL_NAME, messages=messages, stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    assert client(served).models.list().data[0].id == MODEL_NAME


METADATA = (("application", "specserve"),)


def grpc_greedy(address: str, prompt: list[int]) -> tuple[pb.GenerateResponse, list[int]]:
    """A greedy request for MAX_NEW tokens over gRPC, unary and streamed: the answer and the streamed ids."""
    request = pb.GenerateRequest(
        model=MODEL_NAME,
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
    )

    async def call() -> tuple[pb.GenerateResponse, list[int]]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.SpecServeStub(channel)
            unary = await stub.Generate(request, metadata=METADATA)
            streamed = [t async for m in stub.GenerateStream(request, metadata=METADATA) for t in m.token_ids]
            return unary, streamed

    return asyncio.run(call())


def test_grpc_unary_and_stream_equal_the_target(served: dict) -> None:
    prompt = [12, 13, 14, 15, 12, 13]
    expected = reference(served["root"], prompt)
    unary, streamed = grpc_greedy(served["grpc"], prompt)
    assert list(unary.token_ids) == expected and streamed == expected
    assert unary.finish_reason == pb.FINISH_REASON_LENGTH

    async def bad_call() -> None:
        async with grpc.aio.insecure_channel(served["grpc"]) as channel:
            bad_request = pb.GenerateRequest(model=MODEL_NAME, text="hi", sampling=pb.SamplingParams(temperature=-1))
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await pb_grpc.SpecServeStub(channel).Generate(bad_request, metadata=METADATA)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "temperature" in (bad.value.details() or "")
            # bytes that are not a request, through Serve's proxy: INVALID_ARGUMENT, not grpc's UNKNOWN
            raw = channel.unary_unary("/specserve.v1.SpecServe/Generate", request_serializer=None)
            with pytest.raises(grpc.aio.AioRpcError) as garbage:
                await raw(b"\xff\xff\xff garbage", metadata=METADATA)
            assert garbage.value.code() == grpc.StatusCode.INVALID_ARGUMENT, garbage.value.details()
            assert "not a specserve.v1.GenerateRequest" in (garbage.value.details() or "")

    asyncio.run(bad_call())


def test_grpc_health_v1_and_reflection_through_serves_proxy(served: dict) -> None:
    """What `grpc_health_probe -addr=HOST:PORT` (and a Kubernetes `grpc:` probe) sends: Check, service "" and
    "specserve.v1.SpecServe", no metadata at all: SERVING. Reflection (what grpcurl asks) lists both services and
    describes SpecServe's methods."""
    with grpc.insecure_channel(served["grpc"]) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "specserve.v1.SpecServe"):
            answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as unknown:
            health.Check(health_pb2.HealthCheckRequest(service="other.v1.Other"), timeout=30)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
        reflection = ProtoReflectionDescriptorDatabase(channel)
        assert {"specserve.v1.SpecServe", "grpc.health.v1.Health"} <= set(reflection.get_services())
        methods = DescriptorPool(reflection).FindServiceByName("specserve.v1.SpecServe").methods_by_name
        assert {"Generate", "GenerateStream", "Health"} <= set(methods)


def test_grpc_chat_with_n_and_logprobs_equals_http_through_serves_proxies(served: dict) -> None:
    messages = [{"role": "user", "content": "the cat sat on the mat"}]
    fields = {"temperature": 0.9, "top_p": 0.95, "seed": 7, "n": 2, "max_tokens": MAX_NEW, "presence_penalty": 0.3}
    http = client(served).chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        logprobs=True,
        top_logprobs=2,
        **fields,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    sampling = pb.SamplingParams(logprobs=2, ignore_eos=True, **fields)
    chat = pb.Chat(messages=[pb.ChatMessage(**m) for m in messages])
    request = pb.GenerateRequest(chat=chat, sampling=sampling, request_id="e2e-chat")

    async def call() -> pb.GenerateResponse:
        async with grpc.aio.insecure_channel(served["grpc"]) as channel:
            return await pb_grpc.SpecServeStub(channel).Generate(request, metadata=METADATA)

    answer = asyncio.run(call())
    expected = sorted(http.choices, key=lambda c: c.index)
    assert [list(c.token_ids) for c in answer.choices] == [c.model_extra["token_ids"] for c in expected]
    assert [c.text for c in answer.choices] == [c.message.content for c in expected]
    for mine, theirs in zip(answer.choices, expected, strict=True):
        pairs = list(zip(mine.logprobs, theirs.logprobs.content, strict=True))
        assert len(pairs) == MAX_NEW and all(abs(a.logprob - b.logprob) < 1e-5 for a, b in pairs)
    assert answer.request_id == "e2e-chat" and answer.usage.completion_tokens == 2 * MAX_NEW


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"{not json", None),
        (b'{"model": "tiny-llama", "prompt": "hi", "temperature": -1}', "temperature"),
        (b'{"model": "tiny-llama", "prompt": "hi", "top_p": 2}', "top_p"),
        (b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": "many"}', "max_tokens"),
        (b'{"model": "tiny-llama", "prompt": ""}', "prompt"),
        (b'{"model": "tiny-llama", "prompt": "hi", "n": 17}', "n"),
        (b'{"model": "tiny-llama", "prompt": "hi", "bogus": 1, "guided_grammar": "a+"}', "guided_grammar"),
    ],
)
def test_malformed_http_requests_get_400_naming_the_field(served: dict, body: bytes, field: str | None) -> None:
    request = urllib.request.Request(
        served["http"] + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=60)
    assert err.value.code == 400
    error = json.loads(err.value.read())["error"]
    if field is not None:
        assert field in (error.get("param") or "") + error["message"]
    ok = client(served).completions.create(model=MODEL_NAME, prompt="the cat", max_tokens=3, temperature=0.0)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_n_choices_and_ignored_fields_through_serves_proxy(served: dict) -> None:
    """An unknown field is ignored and named in the header, which Serve's HTTP proxy passes on; n = 2 gives two."""
    raw = client(served).completions.with_raw_response.create(
        model=MODEL_NAME, prompt=[7, 8, 9], n=2, seed=3, temperature=1.0, max_tokens=4, extra_body={"bogus": 1}
    )
    assert raw.headers["x-specserve-ignored-fields"] == "bogus"
    assert [c.index for c in raw.parse().choices] == [0, 1]


def metric_total(text: str, name: str) -> float:
    """Sum of every sample of a metric (any tags) in Prometheus text format; Ray prefixes `ray_` (the name exactly:
    `spec_decode_num_drafts_total` is not `vllm_spec_decode_num_drafts_total`, its vLLM-named twin)."""
    total = 0.0
    for line in text.splitlines():
        sample = line.split("{")[0].split(" ")[0]
        if not line.startswith("#") and sample == f"ray_{name}":
            total += float(line.rsplit(" ", 1)[1])
    return total


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST `body` as JSON: the status and the JSON answer, errors included."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_request_whose_logits_turn_nan_at_the_shard_fails_alone_with_a_500_naming_it(served: dict) -> None:
    """In the target shard's process, the target's embedding of one token set to NaN (a model whose arithmetic
    fails on some input): eight requests at once, one of them reading that token. That one gets a 500 whose
    message says its logits are NaN; the seven verified beside it get the target's own tokens."""
    import ray

    from actors.target_replica import SHARD_NAME

    def set_embedding(shard: Any, token: int, value: Any) -> Any:
        """Inside the shard's process (`__ray_call__`): the target's embedding row `token` set to `value`; the old
        row back (the verifiers share one model)."""
        import torch

        weight = shard._verifiers.owners()[0].runner.model.get_input_embeddings().weight
        old = weight[token].clone()
        with torch.no_grad():
            weight[token] = value
        return old

    prompts = [[7 + i, 8, 9 + 2 * i, 10, 11] for i in range(7)]
    expected = [reference(served["root"], p) for p in prompts]
    poison = max(set(range(VOCAB)) - {t for p, out in zip(prompts, expected, strict=True) for t in p + out})
    client(served).completions.create(model=MODEL_NAME, prompt=[7, 8], **GREEDY)  # the shard's verifier exists
    (name,) = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(f"{SHARD_NAME}:")]
    shard = ray.get_actor(name["name"], namespace=name["namespace"])
    old = ray.get(shard.__ray_call__.remote(set_embedding, poison, float("nan")))
    try:
        body = {"model": MODEL_NAME, "temperature": 0.0, "max_tokens": MAX_NEW, "ignore_eos": True}
        bodies = [body | {"prompt": [7, poison, 9]}] + [body | {"prompt": p, "return_token_ids": True} for p in prompts]
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: post(served["http"] + "/v1/completions", b), bodies))
    finally:
        ray.get(shard.__ray_call__.remote(set_embedding, poison, old))
    (status, doomed), *rest = answers
    assert status == 500 and "NaN" in doomed["error"]["message"], doomed
    assert [r["choices"][0]["token_ids"] for _, r in rest] == expected, rest


def test_prometheus_endpoint_shows_speculative_metrics(served: dict) -> None:
    """After requests, Ray's Prometheus endpoint shows draft / accepted counters and acceptance."""
    client(served).completions.create(model=MODEL_NAME, prompt=[7, 8, 9, 7, 8], **GREEDY)
    names = [
        "specserve_draft_tokens_total",
        "specserve_accepted_tokens_total",
        "specserve_acceptance_length_count",
        "specserve_time_to_first_token_seconds_count",
        "specserve_replica_up",
    ]
    deadline = time.monotonic() + 90  # metrics reach the endpoint on Ray's report interval
    totals: dict[str, float] = {}
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(served["metrics"], timeout=10).read().decode()
        totals = {name: metric_total(text, name) for name in names}
        if all(totals.values()):
            break
        time.sleep(2)
    assert all(totals.values()), totals
    assert totals["specserve_replica_up"] >= 2  # one draft and one target replica
    # Ray exports _sum from bucket midpoints; the (0.99, 1] bucket keeps plain-decoding requests at 0.995.
    mean = metric_total(text, "specserve_acceptance_length_sum") / totals["specserve_acceptance_length_count"]
    assert mean >= 0.99, mean


def test_per_request_stats_agree_with_the_prometheus_counters(served: dict) -> None:
    """One request alone: its `metrics.speculative_decoding` equals what it added to the router's Prometheus
    counters (draft tokens, accepted tokens, drafting steps), as Ray's endpoint reports them."""
    names = ("specserve_draft_tokens_total", "specserve_accepted_tokens_total", "spec_decode_num_drafts_total")

    def settled() -> dict[str, float]:
        """The counters once two reads a report interval apart agree (earlier tests' requests all reported)."""
        last: dict[str, float] = {}
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            text = urllib.request.urlopen(served["metrics"], timeout=10).read().decode()
            now = {name: metric_total(text, name) for name in names}
            if now == last:
                return now
            last = now
            time.sleep(6)
        raise AssertionError(f"the counters kept moving: {last}")

    before = settled()
    done = client(served).completions.create(model=MODEL_NAME, prompt=[7, 8, 9, 7, 8, 9], **GREEDY)
    spec = done.model_extra["metrics"]["speculative_decoding"]
    assert spec["num_draft_tokens"] > 0
    deadline = time.monotonic() + 90
    after = settled()
    while after == before and time.monotonic() < deadline:  # the request's increments on the next report
        after = settled()
    added = {name: after[name] - before[name] for name in names}
    assert added == {
        "specserve_draft_tokens_total": spec["num_draft_tokens"],
        "specserve_accepted_tokens_total": spec["num_accepted_draft_tokens"],
        "spec_decode_num_drafts_total": spec["num_spec_steps"],
    }, (added, spec)
