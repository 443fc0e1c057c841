"""A gRPC GenerateRequest as the OpenAI HTTP request of the same fields, planned by the HTTP front door's own code.

One validation for both front doors: the proto's fields become the body of a `/v1/completions` request (a
`text` or `token_ids` prompt) or a `/v1/chat/completions` one (`chat`), under the HTTP API's names, and
`deploy.openai.choices.plan_request` parses and checks it, tokenizes, renders the chat template, compiles the
grammar and makes the `n` choices with their seeds. So a field has the same bounds, defaults and error message on
both; only its name is the proto's path, which `grpc_name` gives an error (`temperature` is
`sampling.temperature`, `messages.[0].role` is `chat.messages.[0].role`, `prompt` is `text` or `token_ids`).

Where the APIs differ, the body says what gRPC means: a prompt without `max_tokens` runs to the end of the
context window (/v1/completions' default is 16; a `text` prompt is tokenized here, as /v1/completions tokenizes
it, to know that room, and sent on as its ids), and `logprobs` (alternatives per token) is chat's
`logprobs: true` with `top_logprobs`.
"""

from __future__ import annotations

import json
from typing import Any

from google.protobuf.json_format import MessageToDict

from actors.admission import ContextWindow
from deploy.front.frontdoor import FrontDoor, RequestError, check_stops
from deploy.openai.api import ChatCompletionRequest, CompletionRequest
from deploy.openai.choices import Plan, plan_request
from proto import specserve_pb2 as pb

MAX_REQUEST_ID = 256  # characters of a client's request id, which every response message carries back

# SamplingParams fields the HTTP API takes under the same name and meaning, sent where the client set them.
_SAME = (
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "max_tokens",
    "ignore_eos",
    "seed",
    "max_draft_tokens",
    "presence_penalty",
    "frequency_penalty",
    "min_p",
    "min_tokens",
    "n",
    "include_stop_str_in_output",
    "skip_special_tokens",
)
_MAX_TOKENS = 1_000_000  # the HTTP API's bound on max_tokens: a default beyond it is clipped to it
_CHAT = (
    "messages",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "prediction",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
)


def plan_generation(
    request: pb.GenerateRequest,
    front: FrontDoor,
    seed: int,
    window: ContextWindow | None = None,
    kv_budget: int | None = None,
) -> Plan:
    """The request's choices (prompt ids, SamplingParams dict, index) as the HTTP front door plans them.

    `seed`: drawn by the caller for a request without one. `window`: what the deployment serves
    (`FrontDoor.served_window`); None: the front door's own. `kv_budget`: a target replica's KV tokens (the
    router's info). RequestError names the field by its proto path. Tokenizes: run it off the event loop.
    """
    which = request.WhichOneof("prompt")
    if which is None:
        raise RequestError("prompt: set `text`, `token_ids` or `chat`", param="prompt")
    s = request.sampling
    try:
        check_stops(s.stop, s.stop_token_ids)  # the cheap refusals before tokenizing, as on HTTP
        body = sampling_body(s)
        window = window or front.served_window({})
        if which == "chat":
            cls: type[CompletionRequest | ChatCompletionRequest] = ChatCompletionRequest
            body |= chat_body(request.chat)
            if s.HasField("logprobs"):
                body |= {"logprobs": True, "top_logprobs": s.logprobs}
        else:
            cls = CompletionRequest
            ids = front.prompts.text(request.text) if which == "text" else list(request.token_ids.ids)
            body["prompt"] = ids
            if s.HasField("logprobs"):
                body["logprobs"] = s.logprobs
            room = window.tokens - len(ids)
            if "max_tokens" not in body and room >= 1:  # gRPC's default: the rest of the window
                body["max_tokens"] = min(room, _MAX_TOKENS)
        body["model"] = request.model or front.model_name
        return plan_request(front, cls, json.dumps(body).encode(), seed, window, kv_budget)
    except RequestError as e:
        raise renamed(e, which) from None


def sampling_body(s: pb.SamplingParams) -> dict[str, Any]:
    """The HTTP body's sampling fields of the ones the client set (`logprobs` aside: its name differs by endpoint)."""
    body: dict[str, Any] = {name: getattr(s, name) for name in _SAME if s.HasField(name)}
    if s.stop:
        body["stop"] = list(s.stop)
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)
    if s.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in s.logit_bias.items()}
    if s.HasField("structured_outputs"):
        body["structured_outputs"] = structured_outputs(s.structured_outputs)
    return body


def structured_outputs(so: pb.StructuredOutputs) -> dict[str, Any]:
    """vLLM's `structured_outputs` object of the proto's one constraint ({} for none)."""
    kind = so.WhichOneof("constraint")
    if kind is None:
        return {}
    if kind == "choice":
        return {"choice": list(so.choice.values)}
    return {kind: getattr(so, kind)}


def chat_body(chat: pb.Chat) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [_message(m) for m in chat.messages]}
    if chat.HasField("chat_template_kwargs"):
        body["chat_template_kwargs"] = MessageToDict(chat.chat_template_kwargs)
    for flag in ("add_generation_prompt", "continue_final_message", "parallel_tool_calls"):
        if chat.HasField(flag):
            body[flag] = getattr(chat, flag)
    if chat.HasField("prediction"):
        body["prediction"] = {"type": "content", "content": chat.prediction}
    if chat.tools:
        body["tools"] = [{"type": "function", "function": _function(t, i)} for i, t in enumerate(chat.tools)]
    choice = chat.WhichOneof("tool_choice")
    if choice == "tool_choice_mode":
        body["tool_choice"] = chat.tool_choice_mode
    elif choice == "tool_choice_function":
        body["tool_choice"] = {"type": "function", "function": {"name": chat.tool_choice_function}}
    return body


def _message(m: pb.ChatMessage) -> dict[str, Any]:
    """A chat message as the HTTP API's: a tool message's call id, an assistant's calls."""
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.HasField("tool_call_id"):
        message["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in m.tool_calls
        ]
    return message


def _function(tool: pb.Tool, index: int) -> dict[str, Any]:
    """A tool as the HTTP API's function definition; RequestError where its parameters are not JSON."""
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters:
        try:
            function["parameters"] = json.loads(tool.parameters)
        except json.JSONDecodeError as e:
            param = f"tools.[{index}].function.parameters"
            raise RequestError(f"{param}: not JSON text ({e})", param=param) from None
    return function


def grpc_name(param: str, prompt: str) -> str:
    """An HTTP field path as the proto names it; `prompt`: the request's prompt field (`text`, `token_ids`, `chat`)."""
    head, dot, rest = param.partition(".")
    if head == "prompt":
        return prompt + dot + rest
    if head in _CHAT:  # the proto's tools and calls hold a function's fields themselves; tool_choice is a oneof
        flat = param.replace(".function.", ".") if head in ("tools", "messages") else param
        return "chat.tool_choice" if head == "tool_choice" else f"chat.{flat}"
    if head == "model":
        return param
    if head == "top_logprobs":  # chat's name of the alternatives per token; gRPC's is `logprobs`
        return "sampling.logprobs" + dot + rest
    return f"sampling.{param}"


def renamed(error: RequestError, prompt: str) -> RequestError:
    """`error` with its field (and the message's leading field) named as in the proto."""
    if error.param is None:
        return error
    param = grpc_name(error.param, prompt)
    message = error.message
    if message.startswith(error.param + ":"):
        message = param + message[len(error.param) :]
    return RequestError(message, param=param, status=error.status, code=error.code, type=error.type)


def request_id(request: pb.GenerateRequest, drawn: str) -> str:
    """The client's request id, or `drawn` where it sent none; RequestError for one too long."""
    if len(request.request_id) > MAX_REQUEST_ID:
        message = f"request_id: at most {MAX_REQUEST_ID} characters (got {len(request.request_id)})"
        raise RequestError(message, param="request_id")
    return request.request_id or drawn
