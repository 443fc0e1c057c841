"""Every sampling field the HTTP API takes, sent over gRPC, gives the HTTP API's tokens; bad values, its refusals.

One in-process server (tests/front_router.py `TinyIngress`) serves both front doors: the OpenAI HTTP API on a
real socket and specserve.v1.SpecServe on a plain grpc.aio server (tests/grpc_helpers.py). Each case sends the
same prompt and the same fields to both: completions and chat, greedy and seeded sampling, `n` choices, log
probabilities, penalties, `logit_bias`, `min_p`, `min_tokens`, stops, structured output. Each choice's token ids,
text, finish reason and log probabilities agree, unary and streamed. The tiny tokenizer decodes byte-level here
(its words without spaces), which llguidance needs to build grammar masks.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import requests
from google.protobuf.struct_pb2 import Struct
from tokenizers import decoders

from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc
from tests.front_router import MODEL_NAME, TinyIngress, front_door, serve_in_thread, tiny_pair, tiny_tokenizer
from tests.grpc_helpers import run_grpc

KEY = "sk-parity"
AUTH = (("authorization", f"Bearer {KEY}"),)
WINDOW = 64
PROMPT = "the quick brown fox"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there !"}]
REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


@pytest.fixture(scope="module")
def ingress() -> TinyIngress:
    tokenizer = tiny_tokenizer()
    tokenizer.backend_tokenizer.decoder = decoders.ByteLevel()  # llguidance reads byte-level tokenizers
    front = front_door(tokenizer, WINDOW, api_key=KEY)
    return TinyIngress(front, *tiny_pair(), grammars=front.grammars)


@pytest.fixture(scope="module")
def server(ingress: TinyIngress) -> Iterator[str]:
    with serve_in_thread(ingress.__serve_build_asgi_app__()) as url:
        yield url


def http(server: str, chat: bool, body: dict[str, Any]) -> requests.Response:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    headers = {"Authorization": f"Bearer {KEY}"}
    return requests.post(server + path, json={"model": MODEL_NAME} | body, headers=headers, timeout=60)


# (case, chat, the HTTP body's fields, the gRPC request's sampling fields); the prompt is PROMPT or MESSAGES
GREEDY_ALL = {
    "temperature": 0.0,
    "max_tokens": 10,
    "top_k": 20,
    "top_p": 0.9,
    "repetition_penalty": 1.2,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.3,
    "min_p": 0.05,
    "min_tokens": 4,
    "seed": 5,
    "max_draft_tokens": 3,
    "skip_special_tokens": False,
}
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.02, "seed": 1234, "max_tokens": 8}
CASES: list[tuple[str, bool, dict[str, Any], dict[str, Any]]] = [
    (
        "completion-greedy-every-field",
        False,
        GREEDY_ALL | {"logprobs": 3, "logit_bias": {"7": 2.5, "11": -1.0}, "stop_token_ids": [2, 9]},
        GREEDY_ALL | {"logprobs": 3, "logit_bias": {7: 2.5, 11: -1.0}, "stop_token_ids": [2, 9]},
    ),
    (
        "completion-sampled-n3",
        False,
        SAMPLED | {"n": 3, "logprobs": 2, "presence_penalty": 0.4, "frequency_penalty": -0.2, "ignore_eos": True},
        SAMPLED | {"n": 3, "logprobs": 2, "presence_penalty": 0.4, "frequency_penalty": -0.2, "ignore_eos": True},
    ),
    (
        "chat-sampled-n2-logprobs",
        True,
        SAMPLED | {"n": 2, "logprobs": True, "top_logprobs": 4, "repetition_penalty": 1.1, "min_tokens": 3},
        SAMPLED | {"n": 2, "logprobs": 4, "repetition_penalty": 1.1, "min_tokens": 3},
    ),
    (
        "chat-greedy-stop-string-kept",
        True,
        {"temperature": 0.0, "max_tokens": 12, "stop": ["dog"], "include_stop_str_in_output": True},
        {"temperature": 0.0, "max_tokens": 12, "stop": ["dog"], "include_stop_str_in_output": True},
    ),
    (
        "completion-sampled-regex-n2",
        False,
        SAMPLED | {"n": 2, "structured_outputs": {"regex": "(red|green|blue)+"}},
        SAMPLED | {"n": 2, "structured_outputs": pb.StructuredOutputs(regex="(red|green|blue)+")},
    ),
    (
        "chat-greedy-choice",
        True,
        {"temperature": 0.0, "guided_choice": ["redgreen", "bluered"]},
        {"temperature": 0.0, "structured_outputs": pb.StructuredOutputs(choice={"values": ["redgreen", "bluered"]})},
    ),
]


def grpc_request(chat: bool, sampling: dict[str, Any], request_id: str = "") -> pb.GenerateRequest:
    params = pb.SamplingParams(**sampling)
    if not chat:
        return pb.GenerateRequest(model=MODEL_NAME, text=PROMPT, sampling=params, request_id=request_id)
    kwargs = Struct()
    kwargs.update({"enable_thinking": False})
    conversation = pb.Chat(messages=[pb.ChatMessage(**m) for m in MESSAGES], chat_template_kwargs=kwargs)
    return pb.GenerateRequest(model=MODEL_NAME, chat=conversation, sampling=params, request_id=request_id)


def http_choices(chat: bool, answer: dict[str, Any]) -> list[tuple[list[int], str, str, list[float]]]:
    """(token ids, text, finish reason, each token's log probability) of each choice, in index order."""
    out = []
    for c in sorted(answer["choices"], key=lambda c: c["index"]):
        lp = c["logprobs"]
        logprobs = [t["logprob"] for t in lp["content"]] if chat and lp else (lp or {}).get("token_logprobs", [])
        text = c["message"]["content"] if chat else c["text"]
        out.append((c["token_ids"], text, c["finish_reason"], logprobs))
    return out


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) < 1e-5 for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(("chat", "body", "sampling"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_grpc_gives_the_http_apis_tokens_for_the_same_fields(
    server: str, ingress: TinyIngress, chat: bool, body: dict[str, Any], sampling: dict[str, Any]
) -> None:
    prompt = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}} if chat else {"prompt": PROMPT}
    answer = http(server, chat, prompt | body | {"return_token_ids": True})
    assert answer.status_code == 200, answer.text
    expected = http_choices(chat, answer.json())
    request = grpc_request(chat, sampling, request_id="parity-1")

    async def scenario(stub: pb_grpc.SpecServeStub) -> tuple[pb.GenerateResponse, list[pb.GenerateStreamResponse]]:
        unary = await stub.Generate(request, metadata=AUTH)
        return unary, [m async for m in stub.GenerateStream(request, metadata=AUTH)]

    unary, stream = run_grpc(ingress, scenario)
    assert [c.index for c in unary.choices] == list(range(len(expected)))
    for choice, (ids, text, reason, logprobs) in zip(unary.choices, expected, strict=True):
        assert list(choice.token_ids) == ids, (choice.index, text)
        assert choice.text == text and choice.finish_reason == REASONS[reason]
        assert close([lp.logprob for lp in choice.logprobs], logprobs)
        assert [lp.token_id for lp in choice.logprobs] == (ids if logprobs else [])
    if chat and "top_logprobs" in body:  # chat lists the alternatives in order, as the proto does
        for choice, http_choice in zip(unary.choices, answer.json()["choices"], strict=True):
            for mine, theirs in zip(choice.logprobs, http_choice["logprobs"]["content"], strict=True):
                assert len(mine.top_logprobs) == body["top_logprobs"]
                assert close([t.logprob for t in mine.top_logprobs], [t["logprob"] for t in theirs["top_logprobs"]])
    first = unary.choices[0]
    assert (list(unary.token_ids), unary.text, unary.finish_reason) == (
        list(first.token_ids),
        first.text,
        first.finish_reason,
    )
    usage = answer.json()["usage"]
    assert (unary.usage.prompt_tokens, unary.usage.completion_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert unary.request_id == "parity-1" and all(m.request_id == "parity-1" for m in stream)
    streamed: dict[int, list[int]] = defaultdict(list)
    texts: dict[int, str] = defaultdict(str)
    for message in stream:
        streamed[message.index] += message.token_ids
        texts[message.index] += message.text
    assert [streamed[i] for i in range(len(expected))] == [e[0] for e in expected]
    assert [texts[i] for i in range(len(expected))] == [e[1] for e in expected]
    last = {m.index: m for m in stream if m.finish_reason != pb.FINISH_REASON_UNSPECIFIED}
    assert sorted(last) == list(range(len(expected))) and all(m.HasField("usage") for m in last.values())


# (case, chat, HTTP fields, gRPC sampling fields, the HTTP param): the same message, under `sampling.` on gRPC
BAD = [
    ("presence-penalty", False, {"presence_penalty": 2.5}, {"presence_penalty": 2.5}, "presence_penalty"),
    ("frequency-penalty", False, {"frequency_penalty": -3.0}, {"frequency_penalty": -3.0}, "frequency_penalty"),
    ("logit-bias-id", False, {"logit_bias": {"99999": 1.0}}, {"logit_bias": {99999: 1.0}}, "logit_bias"),
    ("logit-bias-value", False, {"logit_bias": {"7": 200.0}}, {"logit_bias": {7: 200.0}}, "logit_bias"),
    ("min-p", False, {"min_p": 1.5}, {"min_p": 1.5}, "min_p"),
    (
        "min-tokens-past-max",
        False,
        {"min_tokens": 9, "max_tokens": 4},
        {"min_tokens": 9, "max_tokens": 4},
        "min_tokens",
    ),
    ("logprobs", False, {"logprobs": 21}, {"logprobs": 21}, "logprobs"),
    ("n", False, {"n": 17}, {"n": 17}, "n"),
    ("temperature", True, {"temperature": 2.5}, {"temperature": 2.5}, "temperature"),
    (
        "regex",
        False,
        {"structured_outputs": {"regex": "(unclosed"}},
        {"structured_outputs": pb.StructuredOutputs(regex="(unclosed")},
        "structured_outputs",
    ),
    (
        "grammar",
        False,
        {"structured_outputs": {"grammar": "root ::= ("}},
        {"structured_outputs": pb.StructuredOutputs(grammar="root ::= (")},
        "structured_outputs.grammar",
    ),
    (
        "json-schema",
        True,
        {"structured_outputs": {"json": "{not json"}},
        {"structured_outputs": pb.StructuredOutputs(json="{not json")},
        "structured_outputs",
    ),
]


@pytest.mark.parametrize(("chat", "body", "sampling", "param"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_value_is_the_http_apis_refusal_naming_the_field(
    server: str, ingress: TinyIngress, chat: bool, body: dict[str, Any], sampling: dict[str, Any], param: str
) -> None:
    prompt = {"messages": MESSAGES} if chat else {"prompt": PROMPT}
    refused = http(server, chat, prompt | {"max_tokens": 4} | body)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == param, error
    request = grpc_request(chat, {"max_tokens": 4} | sampling)

    async def scenario(stub: pb_grpc.SpecServeStub) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Generate(request, metadata=AUTH)
        return e.value

    status = run_grpc(ingress, scenario)
    assert status.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert status.details() == f"sampling.{error['message']}", (status.details(), error)


def test_a_chat_prediction_gives_the_http_apis_tokens_and_prediction_counts(server: str, ingress: TinyIngress) -> None:
    """`chat.prediction` is HTTP's `prediction` (Predicted Outputs): the same tokens, and the same accepted and
    rejected prediction tokens in the unary usage and in the stream's last message; a request without one carries
    neither count, and a prediction past the context window is HTTP's refusal under `chat.prediction`."""
    predicted = "hello there ! the quick brown fox jumps"
    body = {"messages": MESSAGES, "temperature": 0.0, "max_tokens": 10, "return_token_ids": True}
    answer = http(server, True, body | {"prediction": {"type": "content", "content": predicted}})
    assert answer.status_code == 200, answer.text
    details = answer.json()["usage"]["completion_tokens_details"]
    counts = (details["accepted_prediction_tokens"], details["rejected_prediction_tokens"])
    assert sum(counts) > 0
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=10)
    chat = pb.Chat(messages=[pb.ChatMessage(**m) for m in MESSAGES], prediction=predicted)
    request = pb.GenerateRequest(model=MODEL_NAME, chat=chat, sampling=sampling)
    plain = pb.GenerateRequest(model=MODEL_NAME, chat=pb.Chat(messages=chat.messages), sampling=sampling)
    too_long = pb.GenerateRequest(model=MODEL_NAME, chat=pb.Chat(messages=chat.messages, prediction="fox " * 200))

    async def scenario(stub: pb_grpc.SpecServeStub) -> tuple[Any, ...]:
        unary = await stub.Generate(request, metadata=AUTH)
        stream = [m async for m in stub.GenerateStream(request, metadata=AUTH)]
        without = await stub.Generate(plain, metadata=AUTH)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Generate(too_long, metadata=AUTH)
        return unary, stream, without, refused.value

    unary, stream, without, refused = run_grpc(ingress, scenario)
    assert list(unary.token_ids) == answer.json()["choices"][0]["token_ids"] == list(without.token_ids)
    assert (unary.usage.accepted_prediction_tokens, unary.usage.rejected_prediction_tokens) == counts
    (last,) = [m for m in stream if m.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
    assert (last.usage.accepted_prediction_tokens, last.usage.rejected_prediction_tokens) == counts
    assert not without.usage.HasField("accepted_prediction_tokens")
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and refused.details().startswith("chat.prediction: ")
