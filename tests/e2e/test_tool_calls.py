"""Tool calling through the official `openai` client on the Qwen pair, speculation on (issue 51).

The HTTP front door over the in-process router (tests/front_router.py): Qwen2.5-Coder-1.5B-Instruct verifies what
Qwen2.5-Coder-0.5B-Instruct drafts (float32), with the Qwen tokenizer and its chat template, which lists the tools
and asks for Hermes-style `<tool_call>` calls. A round trip (the model calls the tool, its result goes back as a
`tool` message, the model answers in words), streamed and not; `tool_choice: required` and a named function give
a call whose arguments validate against the tool's schema; greedy output with tools equals plain decoding. gRPC
carries the same tools and reads the same calls.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grpc
import jsonschema
import openai
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc
from speculative.engine import gguf_weights
from speculative.engine.invariant import make_deterministic
from speculative.engine.loading import with_kernels
from speculative.rules.grammar import GrammarCompiler
from tests.fetched import fetched_dir
from tests.front_router import MODEL_NAME, TinyIngress, front_door, serve_in_thread
from tests.grpc_helpers import run_grpc

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 40}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The current weather in a city.", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The current time in a timezone.", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
# An agent's system prompt: without one, this 1.5B model calls the tool again instead of reading its result.
SYSTEM = (
    "You are a helpful assistant. Call a tool when you need data; once a tool has responded, answer the user in "
    "plain words."
)
ASK: list[Any] = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is the weather like in Paris right now, in celsius?"},
]
GREEDY: dict[str, Any] = {
    "model": MODEL_NAME,
    "temperature": 0,
    "max_tokens": 48,
    "extra_body": {"return_token_ids": True},
}
PLAIN: dict[str, Any] = GREEDY | {"extra_body": {"return_token_ids": True, "max_draft_tokens": 0}}  # no speculation


def _loaded(name: str) -> Any:
    return AutoModelForCausalLM.from_pretrained(str(fetched_dir(name)), dtype="float32").eval()


@pytest.fixture(scope="module")
def ingress() -> TinyIngress:
    tokenizer = AutoTokenizer.from_pretrained(str(fetched_dir("qwen-1.5b")))
    # The served path's CPU kernels (deploy/local.yaml), in float32 activations on every CPU: the target at its
    # GGUF file's precision, its forwards batch invariant as a replica makes them, where this CPU runs the kernel
    # (else its Linear layers prepacked through oneDNN); the draft's quantized as `draft_quantize: auto` picks.
    target = _loaded("qwen-1.5b")
    folder = fetched_dir("qwen-1.5b")
    if gguf_weights.unavailable(folder, target) is None:
        gguf_weights.use_stored(target, gguf_weights.gguf_file(folder))  # type: ignore[arg-type]
        assert make_deterministic(target) is None
    else:
        target = with_kernels(target, "none", "onednn")
    draft = with_kernels(_loaded("qwen-0.5b"), "int8", "onednn")
    grammars = GrammarCompiler.from_hf(tokenizer)
    return TinyIngress(front_door(tokenizer, 4096), target, draft, grammars=grammars)


@pytest.fixture(scope="module")
def client(ingress: TinyIngress) -> Iterator[openai.OpenAI]:
    with serve_in_thread(ingress.__serve_build_asgi_app__()) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _valid_call(call: Any, names: tuple[str, ...]) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names, call.function.name
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def _streamed(client: openai.OpenAI, **fields: Any) -> tuple[str, list[dict[str, str]], str | None]:
    """A streamed chat's content, its calls put together from the deltas (as the openai client's users do), and
    its finish reason."""
    content, calls, reason = "", dict[int, dict[str, str]](), None
    for chunk in client.chat.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += delta.function.name or "" if delta.function else ""
                call["arguments"] += delta.function.arguments or "" if delta.function else ""
            reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


def _token_ids(reply: Any) -> list[int]:
    return list(reply.choices[0].model_extra["token_ids"])


def test_a_tool_call_round_trip_streamed_and_not_as_plain_decoding_would(client: openai.OpenAI) -> None:
    asked = client.chat.completions.create(**GREEDY, messages=ASK, tools=TOOLS)
    choice = asked.choices[0]
    print("asked:", choice.message, asked.usage)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert _valid_call(call, ("get_weather",)) == {"city": "Paris", "unit": "celsius"}
    assert asked.usage and asked.usage.model_extra and asked.usage.model_extra["accepted_tokens"] > 0  # speculated
    plain = client.chat.completions.create(**PLAIN, messages=ASK, tools=TOOLS)
    assert _token_ids(plain) == _token_ids(asked)

    content, streamed, reason = _streamed(client, **GREEDY, messages=ASK, tools=TOOLS)
    assert reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in streamed] == [(call.function.name, call.function.arguments)]

    result = {"city": "Paris", "temperature": 21, "unit": "celsius", "sky": "sunny"}
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)},
    ]
    answer = client.chat.completions.create(**GREEDY, messages=history, tools=TOOLS)
    print("answer:", answer.choices[0].message)
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls
    text = answer.choices[0].message.content or ""
    assert "21" in text, text  # the answer reads the tool's result
    assert _streamed(client, **GREEDY, messages=history, tools=TOOLS) == (text, [], "stop")


def test_required_and_named_tool_choice_give_calls_that_validate(client: openai.OpenAI) -> None:
    # No reason to call a tool: the grammar makes it one call (parallel_tool_calls false), as plain decoding would.
    chat = [{"role": "user", "content": "Tell me a joke about tools."}]
    fields: dict[str, Any] = {"messages": chat, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    required = client.chat.completions.create(**GREEDY, **fields)
    print("required:", required.choices[0].message)
    assert required.choices[0].finish_reason == "tool_calls" and required.choices[0].message.content is None
    [call] = required.choices[0].message.tool_calls or []
    _valid_call(call, ("get_weather", "get_time"))
    plain = client.chat.completions.create(**PLAIN, **fields)
    assert _token_ids(plain) == _token_ids(required)

    named: Any = {"type": "function", "function": {"name": "get_time"}}  # for the weather question: it is obeyed
    reply = client.chat.completions.create(**GREEDY, messages=ASK, tools=TOOLS, tool_choice=named)
    print("named:", reply.choices[0].message)
    [call] = reply.choices[0].message.tool_calls or []
    _valid_call(call, ("get_time",))
    _, streamed, reason = _streamed(client, **GREEDY, messages=ASK, tools=TOOLS, tool_choice=named)
    assert reason == "tool_calls" and [c["arguments"] for c in streamed] == [call.function.arguments]


def test_grpc_carries_the_tools_and_reads_the_calls_the_http_api_reads(
    ingress: TinyIngress, client: openai.OpenAI
) -> None:
    """gRPC's chat carries `tools` (parameters as JSON text), a named tool choice, and a round trip's assistant calls
    and tool result: the HTTP API's tokens, and the same calls read out of them, unary and streamed (each call
    whole, once), finishing with FINISH_REASON_TOOL_CALLS; a tool choice naming no tool is HTTP's refusal under the
    proto's name, and parameters that are not JSON are refused naming them."""
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    asked = client.chat.completions.create(**GREEDY, messages=ASK, tools=TOOLS, tool_choice=named)
    [call] = asked.choices[0].message.tool_calls or []
    result = {"city": "Paris", "temperature": 21, "unit": "celsius", "sky": "sunny"}
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)},
    ]
    answer = client.chat.completions.create(**GREEDY, messages=history, tools=TOOLS)

    tools = [
        pb.Tool(name=f["name"], description=f["description"], parameters=json.dumps(f["parameters"]))
        for f in (t["function"] for t in TOOLS)
    ]
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=GREEDY["max_tokens"])
    ask = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in ASK]
    chat = pb.Chat(messages=ask, tools=tools, tool_choice_function="get_weather")
    made = pb.ToolCall(id=call.id, name=call.function.name, arguments=call.function.arguments)
    back = [
        *ask,
        pb.ChatMessage(role="assistant", content="", tool_calls=[made]),
        pb.ChatMessage(role="tool", tool_call_id=call.id, content=json.dumps(result)),
    ]
    request = pb.GenerateRequest(model=MODEL_NAME, chat=chat, sampling=sampling)
    follow = pb.GenerateRequest(model=MODEL_NAME, chat=pb.Chat(messages=back, tools=tools), sampling=sampling)
    nameless = pb.GenerateRequest(chat=pb.Chat(messages=ask, tools=tools, tool_choice_function="nope"))
    broken = pb.GenerateRequest(chat=pb.Chat(messages=ask, tools=[pb.Tool(name="f", parameters="{")]))

    async def scenario(stub: pb_grpc.SpecServeStub) -> tuple[Any, ...]:
        unary = await stub.Generate(request)
        stream = [m async for m in stub.GenerateStream(request)]
        followed = await stub.Generate(follow)
        refusals = []
        for bad in (nameless, broken):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(bad)
            refusals.append(refused.value)
        return unary, stream, followed, refusals

    unary, stream, followed, (refused, unparsed) = run_grpc(ingress, scenario)
    called = [(call.function.name, call.function.arguments)]
    assert list(unary.token_ids) == _token_ids(asked) == [t for m in stream for t in m.token_ids]
    assert [(c.name, c.arguments) for c in unary.tool_calls] == called and unary.tool_calls[0].id.startswith("call_")
    assert unary.finish_reason == pb.FINISH_REASON_TOOL_CALLS == stream[-1].finish_reason
    assert [(c.name, c.arguments) for m in stream for c in m.tool_calls] == called
    assert list(followed.token_ids) == _token_ids(answer)
    assert followed.finish_reason == pb.FINISH_REASON_STOP and not followed.tool_calls
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details().startswith("chat.tool_choice: 'nope' is none of the tools"), refused.details()
    assert unparsed.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert unparsed.details().startswith("chat.tools.[0].parameters: not JSON text"), unparsed.details()


def test_tool_fields_that_cannot_be_honoured_get_400_naming_them(client: openai.OpenAI) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.[1].function.name"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}, "tool_choice": "required"}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.[0].function.name"),
        (
            {
                "messages": [*ASK, {"role": "tool", "content": "21 degrees"}],
                "tools": TOOLS,
            },
            "messages.[2].tool_call_id",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{"}}],
                    },
                ]
            },
            "messages.[2].tool_calls.[0].function.arguments",
        ),
    ]
    for fields, param in cases:
        body = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 4} | fields
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**body)
        assert e.value.body and e.value.body.get("param") == param, (param, e.value.body)  # type: ignore[union-attr]
