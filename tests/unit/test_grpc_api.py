"""The gRPC front door (specserve.v1.SpecServe, grpc.health.v1's Check) on a plain grpc.aio server over the tiny
real router.

Serve's gRPC proxy calls the same `GrpcIngress` methods; here `PlainServicer` (tests/grpc_helpers.py)
hosts them and applies their status the way the proxy does. Needs the generated stubs (`make proto`).
tests/unit/test_grpc_http_parity.py holds every sampling field against the HTTP API's answers.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from google.protobuf.struct_pb2 import Struct
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.front.grpc_decoding import GRPC_SERVICER_FUNCTIONS, add_servicer
from deploy.grpc.ingress import SERVICE
from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc
from tests.front_router import MODEL_NAME, TinyIngress, front_door, tiny_pair, tiny_tokenizer
from tests.grpc_helpers import run_grpc
from tests.tiny_models import reference_greedy

KEY = "grpc-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
WINDOW = 64


@pytest.fixture(scope="module")
def models():
    return tiny_pair()


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def ingress(models, tokenizer) -> TinyIngress:
    return TinyIngress(front_door(tokenizer, WINDOW, api_key=KEY), *models)


def greedy(ids: list[int], max_tokens: int, **sampling: Any) -> pb.GenerateRequest:
    params = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **sampling)
    return pb.GenerateRequest(model=MODEL_NAME, token_ids=pb.TokenIds(ids=ids), sampling=params)


def test_servicer_function_is_importable_for_serve() -> None:
    from ray.serve.config import gRPCOptions

    options = gRPCOptions(grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS)
    assert options.grpc_servicer_func_callable == [add_servicer]


def test_unary_and_stream_give_the_targets_greedy_tokens(ingress: TinyIngress, models, tokenizer) -> None:
    prompt = tokenizer.encode("the quick brown fox")
    request = greedy(prompt, 12)

    async def scenario(stub: pb_grpc.SpecServeStub) -> tuple[Any, list[Any], Any]:
        health = await stub.Health(pb.HealthRequest())
        unary = await stub.Generate(request, metadata=AUTH)
        stream = [m async for m in stub.GenerateStream(request, metadata=AUTH)]
        return health, stream, unary

    health, stream, unary = run_grpc(ingress, scenario)
    assert health.status == pb.HealthResponse.SERVING_STATUS_SERVING
    assert (health.model, health.context_window) == (MODEL_NAME, WINDOW)
    assert list(unary.token_ids) == reference_greedy(models[0], prompt, 12)
    assert unary.text == tokenizer.decode(list(unary.token_ids), skip_special_tokens=True)
    assert unary.finish_reason == pb.FINISH_REASON_LENGTH and unary.model == MODEL_NAME
    assert unary.usage.prompt_tokens == len(prompt) and unary.usage.completion_tokens == 12
    assert unary.usage.draft_tokens >= unary.usage.accepted_tokens and unary.usage.acceptance_length >= 1.0
    assert [t for m in stream for t in m.token_ids] == list(unary.token_ids)
    assert "".join(m.text for m in stream) == unary.text
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not m.HasField("usage") for m in stream[:-1])
    assert stream[-1].finish_reason == pb.FINISH_REASON_LENGTH and stream[-1].usage == unary.usage


def test_text_prompt_and_stop_string(ingress: TinyIngress, tokenizer) -> None:
    params = pb.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    request = pb.GenerateRequest(text="hello world", sampling=params)  # model unset: the served model

    async def scenario(stub: pb_grpc.SpecServeStub) -> tuple[Any, Any]:
        full = await stub.Generate(request, metadata=AUTH)
        stop = full.text.split()[1]
        request.sampling.stop.append(stop)
        return full, await stub.Generate(request, metadata=AUTH)

    full, cut = run_grpc(ingress, scenario)
    assert full.usage.prompt_tokens == len(tokenizer.encode("hello world"))
    assert cut.finish_reason == pb.FINISH_REASON_STOP
    assert cut.text == full.text[: full.text.index(full.text.split()[1])]


BAD = [
    ("no-prompt", pb.GenerateRequest(model=MODEL_NAME), grpc.StatusCode.INVALID_ARGUMENT, "prompt: set"),
    ("empty-text", pb.GenerateRequest(text=""), grpc.StatusCode.INVALID_ARGUMENT, "text: must not be empty"),
    ("empty-ids", pb.GenerateRequest(token_ids=pb.TokenIds()), grpc.StatusCode.INVALID_ARGUMENT, "token_ids: must"),
    ("top-p-zero", greedy([5, 6], 4, top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p:"),
    ("temperature-high", greedy([5, 6], 4), grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature:"),
    ("max-tokens-zero", greedy([5, 6], 0), grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens:"),
    ("beyond-window", greedy([5] * WINDOW, 4), grpc.StatusCode.INVALID_ARGUMENT, "token_ids: 64 tokens"),
    ("max-tokens-overflow", greedy([5, 6], WINDOW), grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens: 64"),
    ("empty-stop", greedy([5, 6], 4, stop=["x", ""]), grpc.StatusCode.INVALID_ARGUMENT, "sampling.stop"),
    ("out-of-vocab", greedy([5, 9999], 4), grpc.StatusCode.INVALID_ARGUMENT, "token_ids:"),
    ("unknown-model", pb.GenerateRequest(model="gpt-9", text="hi"), grpc.StatusCode.NOT_FOUND, "gpt-9"),
    ("temperature-negative", greedy([5, 6], 4), grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature:"),
    ("top-p-above-one", greedy([5, 6], 4, top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p:"),
    ("penalty-zero", greedy([5, 6], 4, repetition_penalty=0.0), grpc.StatusCode.INVALID_ARGUMENT, "repetition_penalty"),
    (
        "penalty-high",
        greedy([5, 6], 4, repetition_penalty=11.0),
        grpc.StatusCode.INVALID_ARGUMENT,
        "repetition_penalty",
    ),
    ("seed-too-big", greedy([5, 6], 4, seed=2**63), grpc.StatusCode.INVALID_ARGUMENT, "sampling.seed"),
    ("draft-too-deep", greedy([5, 6], 4, max_draft_tokens=65), grpc.StatusCode.INVALID_ARGUMENT, "max_draft_tokens"),
]
BAD[4][1].sampling.temperature = 1000.0
BAD[11][1].sampling.temperature = -0.5


@pytest.mark.parametrize(("request_", "code", "words"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_requests_are_refused_in_unary_and_stream(
    ingress: TinyIngress, request_: pb.GenerateRequest, code: grpc.StatusCode, words: str
) -> None:
    async def scenario(stub: pb_grpc.SpecServeStub) -> tuple[list[grpc.aio.AioRpcError], Any]:
        errors = []
        for call in (stub.Generate(request_, metadata=AUTH), _drain(stub.GenerateStream(request_, metadata=AUTH))):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call
            errors.append(e.value)
        return errors, await stub.Generate(greedy([5, 6], 3), metadata=AUTH)

    errors, after = run_grpc(ingress, scenario)
    for error in errors:
        assert error.code() == code and words in (error.details() or ""), error
    assert len(after.token_ids) == 3  # the server keeps serving


def test_missing_key_and_full_router(ingress: TinyIngress) -> None:
    async def scenario(stub: pb_grpc.SpecServeStub) -> list[grpc.aio.AioRpcError]:
        errors = []
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Generate(greedy([5, 6], 3))
        errors.append(e.value)
        ingress.max_active = 0
        try:
            for call in (
                stub.Generate(greedy([5, 6], 3), metadata=AUTH),
                _drain(stub.GenerateStream(greedy([5], 3), metadata=AUTH)),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                errors.append(e.value)
        finally:
            ingress.max_active = 8
        return errors

    unauthenticated, *exhausted = run_grpc(ingress, scenario)
    assert unauthenticated.code() == grpc.StatusCode.UNAUTHENTICATED
    for error in exhausted:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("retry-after", "2") in tuple(error.trailing_metadata() or ())


async def _drain(call: Any) -> list[Any]:
    return [m async for m in call]


def test_bytes_that_are_not_a_request_get_invalid_argument(ingress: TinyIngress) -> None:
    """grpc's own decoding answers such bytes with UNKNOWN, a server fault to the client; `add_servicer`'s decoder
    hands them on and the ingress names what it expected. The server serves on."""

    async def scenario(channel: grpc.aio.Channel) -> tuple[list[grpc.aio.AioRpcError], Any]:
        errors = []
        for method, kind in (("Generate", channel.unary_unary), ("GenerateStream", channel.unary_stream)):
            call = kind(f"/specserve.v1.SpecServe/{method}", request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                reply = call(b"\xff\xff\xff garbage", metadata=AUTH)
                await (reply if method == "Generate" else _drain(reply))
            errors.append(e.value)
        return errors, await pb_grpc.SpecServeStub(channel).Generate(greedy([5, 6, 7], 2), metadata=AUTH)

    errors, after = run_grpc(ingress, scenario, raw=True)
    for error in errors:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
        assert "not a specserve.v1.GenerateRequest" in (error.details() or "")
    assert len(after.token_ids) == 2


def chat_request(*messages: tuple[str, str], **chat: Any) -> pb.GenerateRequest:
    conversation = pb.Chat(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages], **chat)
    return pb.GenerateRequest(chat=conversation, sampling=pb.SamplingParams(temperature=0.0, max_tokens=3))


STRUCT = Struct()
STRUCT.update({"tools": []})  # a name the template render takes itself
CHAT_BAD = [  # (case, request, what the details start with): the field by its proto path
    ("no-messages", chat_request(), "chat.messages: "),
    ("unknown-role", chat_request(("robot", "hi")), "chat.messages.[0].role: "),
    (
        "template-variable",
        chat_request(("user", "hi"), chat_template_kwargs=STRUCT),
        "chat.chat_template_kwargs.tools: ",
    ),
    (
        "continue-and-open",
        chat_request(("user", "hi"), ("assistant", "one"), continue_final_message=True),
        "chat.continue_final_message: ",
    ),
    ("request-id-too-long", pb.GenerateRequest(text="hi", request_id="x" * 257), "request_id: at most 256"),
    (
        "grammar-without-masks",  # the tiny WordLevel tokenizer has no byte decoder llguidance can read
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(structured_outputs=pb.StructuredOutputs(regex="a+"))),
        "sampling.structured_outputs: structured output is not available",
    ),
    ("top-k-beyond", greedy([5, 6], 4, top_k=2_000_000), "sampling.top_k: "),
    ("stop-token-beyond", greedy([5, 6], 4, stop_token_ids=[2**31]), "sampling.stop_token_ids.[0]: "),
    (
        "bias-not-finite",
        greedy([5, 6], 4, logit_bias={7: float("inf")}),
        "sampling.logit_bias.7: input should be a finite",
    ),
]


@pytest.mark.parametrize(("request_", "words"), [b[1:] for b in CHAT_BAD], ids=[b[0] for b in CHAT_BAD])
def test_chat_and_new_fields_are_refused_naming_their_proto_path(
    ingress: TinyIngress, request_: pb.GenerateRequest, words: str
) -> None:
    async def scenario(stub: pb_grpc.SpecServeStub) -> list[grpc.aio.AioRpcError]:
        errors = []
        for call in (stub.Generate(request_, metadata=AUTH), _drain(stub.GenerateStream(request_, metadata=AUTH))):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call
            errors.append(e.value)
        return errors

    for error in run_grpc(ingress, scenario):
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and (error.details() or "").startswith(words), error


def test_a_chat_prompt_is_the_rendered_template_and_ids_are_drawn(ingress: TinyIngress, models, tokenizer) -> None:
    """A `chat` prompt runs on the chat template's rendering (greedy: the target's own tokens for it); a request
    without an id gets one drawn, on every message."""
    request = chat_request(("system", "one two three"), ("user", "hello there !"))  # no <unk>: HF would mask it
    request.sampling.ignore_eos, request.sampling.max_tokens = True, 6
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "one two three"}, {"role": "user", "content": "hello there !"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt = tokenizer.encode(str(rendered), add_special_tokens=False)

    async def scenario(stub: pb_grpc.SpecServeStub) -> tuple[pb.GenerateResponse, list[pb.GenerateStreamResponse]]:
        return await stub.Generate(request, metadata=AUTH), await _drain(stub.GenerateStream(request, metadata=AUTH))

    unary, stream = run_grpc(ingress, scenario)
    assert list(unary.token_ids) == reference_greedy(models[0], prompt, 6)
    assert unary.usage.prompt_tokens == len(prompt)
    assert unary.request_id.startswith("req-") and len(unary.request_id) == 36
    assert len({m.request_id for m in stream}) == 1 and stream[0].request_id not in ("", unary.request_id)


def test_grpc_health_v1_check_answers_as_grpc_health_probe_asks(
    ingress: TinyIngress, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `grpc_health_probe -addr=...` (and a Kubernetes `grpc:` probe) does: Check with service "" and with the
    service's name, no API key; SERVING while the target pool answers, NOT_SERVING while it is silent. An unknown
    service is NOT_FOUND; Watch is UNIMPLEMENTED (only Check is registered)."""

    async def scenario(channel: grpc.aio.Channel) -> dict[str, Any]:
        stub = health_pb2_grpc.HealthStub(channel)
        answers: dict[str, Any] = {s: await stub.Check(health_pb2.HealthCheckRequest(service=s)) for s in ("", SERVICE)}
        for name, call in (
            ("unknown", stub.Check(health_pb2.HealthCheckRequest(service="other.v1.Other"))),
            ("watch", _drain(stub.Watch(health_pb2.HealthCheckRequest()))),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call
            answers[name] = e.value.code()
        return answers

    answers = run_grpc(ingress, scenario, raw=True)
    assert [answers[s].status for s in ("", SERVICE)] == [health_pb2.HealthCheckResponse.SERVING] * 2
    assert answers["unknown"] == grpc.StatusCode.NOT_FOUND and answers["watch"] == grpc.StatusCode.UNIMPLEMENTED

    async def silent() -> dict[str, Any]:
        raise TimeoutError("target pool did not answer")

    monkeypatch.setattr(ingress, "info", silent)

    async def check(channel: grpc.aio.Channel) -> Any:
        return await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())

    assert run_grpc(ingress, check, raw=True).status == health_pb2.HealthCheckResponse.NOT_SERVING


async def _until(condition: Any, timeout: float = 30.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    return bool(condition())


def test_a_cancelled_call_is_the_abort_its_sequences_drop(ingress: TinyIngress) -> None:
    """A client that cancels a stream (after its first message) or a unary call (while it runs): the router's
    sequences of every choice drop, and the server serves on."""
    long = greedy([5, 6, 7], WINDOW - 3, n=3)

    async def scenario(stub: pb_grpc.SpecServeStub) -> tuple[list[int], list[int], Any]:
        stream = stub.GenerateStream(long, metadata=AUTH)
        first = await anext(aiter(stream))
        held = [ingress.active]  # one sequence per choice, while the stream is open
        stream.cancel()
        assert await _until(lambda: ingress.active == 0)
        unary = stub.Generate(long, metadata=AUTH)
        assert await _until(lambda: ingress.active == 3)
        held.append(ingress.active)
        unary.cancel()
        assert await _until(lambda: ingress.active == 0)
        with pytest.raises(asyncio.CancelledError):
            await unary
        return held, list(first.token_ids), await stub.Generate(greedy([5, 6], 3), metadata=AUTH)

    held, first, after = run_grpc(ingress, scenario)
    assert held == [3, 3] and first and len(after.token_ids) == 3
    assert not ingress.decoder.active  # the decoder holds no sequence of theirs
