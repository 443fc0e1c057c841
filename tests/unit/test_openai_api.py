"""The OpenAI-compatible HTTP front door over a real in-process router (tiny models, no Ray).

Malformed requests get OpenAI's error body with the right status and the field named; the server
keeps serving afterwards. Streams are well-formed SSE whose tokens add up to the non-streaming
result, which is the target's own greedy output. The official `openai` client talks to it over a
real socket (uvicorn in a thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient

from deploy.front.frontdoor import Detokenizer
from tests.front_router import MODEL_NAME, TinyIngress, front_door, serve_in_thread, tiny_pair, tiny_tokenizer
from tests.tiny_models import reference_greedy

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
WINDOW = 64  # context window: small, so over-long prompts are cheap to send


@pytest.fixture(scope="module")
def models():
    return tiny_pair()


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def ingress(models, tokenizer) -> TinyIngress:
    return TinyIngress(front_door(tokenizer, WINDOW, api_key=KEY), *models)


@pytest.fixture(scope="module")
def client(ingress: TinyIngress) -> Iterator[TestClient]:
    with TestClient(ingress.__serve_build_asgi_app__(), headers=AUTH) as c:
        yield c


def completion(**overrides: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 4, "temperature": 0} | overrides


def chat(**overrides: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "how are you today ?"}]
    return {"model": MODEL_NAME, "messages": messages, "max_tokens": 4, "temperature": 0} | overrides


LONG = " ".join(["one two three four"] * 20)  # 80 tokens > WINDOW
CMP, CHAT = "completions", "chat/completions"


def msg(**fields: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "hi"} | fields]


def case(name: str, path: str, body: Any, status: int, param: str | None, words: str, headers: Any = None) -> Any:
    """One malformed request: what to send, and the status, `param` and message words expected."""
    return pytest.param(path, body, headers, status, param, words, id=name)


IMAGE = [{"type": "image_url", "image_url": {"url": "http://x"}}]
BAD = [
    case("malformed-json", CMP, b'{"model": "tiny-llama", "prompt": ', 400, None, "parse the JSON"),
    case("not-an-object", CMP, b"[1, 2]", 400, None, "object"),
    case("unknown-model", CMP, completion(model="gpt-9"), 404, "model", "gpt-9"),
    case("missing-model", CMP, {"prompt": "hi"}, 400, "model", "required"),
    case("missing-prompt", CMP, {"model": MODEL_NAME}, 400, "prompt", "required"),
    case("temperature-string", CMP, completion(temperature="0.5"), 400, "temperature", "number"),
    case("temperature-high", CMP, completion(temperature=3), 400, "temperature", "less than"),
    case("top-p-zero", CMP, completion(top_p=0), 400, "top_p", "greater than"),
    case("top-p-high", CHAT, chat(top_p=1.5), 400, "top_p", "less than"),
    case("top-k-negative", CMP, completion(top_k=-5), 400, "top_k", "greater than"),
    case("max-tokens-zero", CMP, completion(max_tokens=0), 400, "max_tokens", "greater than"),
    case("max-tokens-float", CMP, completion(max_tokens=2.5), 400, "max_tokens", "integer"),
    case("seed-negative", CMP, completion(seed=-1), 400, "seed", "greater than"),
    case("max-draft-negative", CMP, completion(max_draft_tokens=-1), 400, "max_draft_tokens", "greater than"),
    case("max-draft-high", CHAT, chat(max_draft_tokens=65), 400, "max_draft_tokens", "less than"),
    case("prompt-too-long", CMP, completion(prompt=LONG), 400, "prompt", "context window"),
    case("max-tokens-overflow", CMP, completion(max_tokens=WINDOW), 400, "max_tokens", "context window"),
    case("chat-overflow", CHAT, chat(max_completion_tokens=500), 400, "max_completion_tokens", "fit"),
    case("empty-prompt", CMP, completion(prompt=""), 400, "prompt", "empty"),
    case("empty-token-list", CMP, completion(prompt=[]), 400, "prompt", "empty"),
    case("prompt-wrong-type", CMP, completion(prompt={"text": "hi"}), 400, "prompt", "must be a string"),
    case("token-id-out-of-vocab", CMP, completion(prompt=[5, 9999]), 400, "prompt", "token ids"),
    case("too-many-prompts", CMP, completion(prompt=["hello"] * 33), 400, "prompt", "at most 32"),
    case("too-many-choices", CMP, completion(prompt=["hello"] * 8, n=9), 400, "n", "at most 64"),
    case("empty-prompt-in-batch", CMP, completion(prompt=["hello", ""]), 400, "prompt.[1]", "empty"),
    case("empty-messages", CHAT, chat(messages=[]), 400, "messages", "at least 1"),
    case("missing-messages", CHAT, {"model": MODEL_NAME}, 400, "messages", "required"),
    case("bad-role", CHAT, chat(messages=msg(role="wizard")), 400, "messages.[0].role", "'user'"),
    case("content-wrong-type", CHAT, chat(messages=msg(content=7)), 400, "messages.[0].content", "must be a string"),
    case("image-part", CHAT, chat(messages=msg(content=IMAGE)), 400, "messages.[0].content", "text parts"),
    case("n-high", CMP, completion(n=17), 400, "n", "less than or equal to 16"),
    case("n-string", CHAT, chat(n="2"), 400, "n", "integer"),
    case("best-of-above-n", CMP, completion(n=2, best_of=3), 400, "best_of", "best_of = n"),
    case("echo-string", CMP, completion(echo="yes"), 400, "echo", "boolean"),
    case("skip-special-string", CHAT, chat(skip_special_tokens="no"), 400, "skip_special_tokens", "boolean"),
    case("template-kwargs-list", CHAT, chat(chat_template_kwargs=[1]), 400, "chat_template_kwargs", "object"),
    case(
        "template-kwarg-of-the-render",
        CHAT,
        chat(chat_template_kwargs={"tokenize": True}),
        400,
        "chat_template_kwargs.tokenize",
        "not a template variable",
    ),
    case(
        "template-kwarg-not-a-name",
        CHAT,
        chat(chat_template_kwargs={"a b": 1}),
        400,
        "chat_template_kwargs",
        "not a template variable name",
    ),
    case("structural-tag", CHAT, chat(structural_tag={"begin": "<f>"}), 400, "structural_tag", "structured output"),
    case("grammar-not-compiling", CHAT, chat(guided_grammar="root ::= b"), 400, "guided_grammar", "does not compile"),
    case(
        "schema-not-compiling",
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
        400,
        "response_format",
        "does not compile",
    ),
    case(
        "schema-missing",
        CHAT,
        chat(response_format={"type": "json_schema"}),
        400,
        "response_format.json_schema",
        "required",
    ),
    case("format-type", CMP, completion(response_format={"type": "xml"}), 400, "response_format.type", "'json_schema'"),
    case("regex-not-compiling", CMP, completion(guided_regex="(ab"), 400, "guided_regex", "unclosed group"),
    case(
        "structured-grammar",
        CHAT,
        chat(structured_outputs={"grammar": "root ::= x"}),
        400,
        "structured_outputs.grammar",
        "Rule 'x' not found",
    ),
    case("two-grammars", CMP, completion(guided_json={}, guided_regex="a+"), 400, "guided_regex", "at most one"),
    case("beam-search", CMP, completion(use_beam_search=True), 400, "use_beam_search", "beam search"),
    case("min-tokens", CMP, completion(min_tokens=30, max_tokens=3), 400, "min_tokens", "more than max_tokens"),
    case("empty-stop", CMP, completion(stop=["ok", ""]), 400, "stop", "empty"),
    case("stop-wrong-type", CMP, completion(stop=5), 400, "stop", "must be a string"),
    case(
        "stream-options-alone", CMP, completion(stream_options={"include_usage": True}), 400, "stream_options", "true"
    ),
    case("presence-penalty", CHAT, chat(presence_penalty=2.5), 400, "presence_penalty", "less than or equal to 2"),
    case("logprobs", CMP, completion(logprobs=21), 400, "logprobs", "less than or equal to 20"),
    case("bad-stream-request", CMP, completion(stream=True, top_p=7), 400, "top_p", "less than"),
    case("missing-api-key", CMP, completion(), 401, None, "API key", headers={"Authorization": ""}),
    case("wrong-api-key", CHAT, chat(), 401, None, "Incorrect API key", headers={"Authorization": "Bearer sk-no"}),
    case("unknown-route", "completion", completion(), 404, None, "Not Found"),
]


@pytest.mark.parametrize(("path", "body", "headers", "status", "param", "words"), BAD)
def test_malformed_request_is_refused_and_server_keeps_serving(
    client: TestClient, path: str, body: Any, headers: dict[str, str] | None, status: int, param: str | None, words: str
) -> None:
    kwargs: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = client.post(f"/v1/{path}", headers=headers, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert words in error["message"]
    if param is not None:
        assert error["message"].startswith(param) or param in error["message"]
    ok = client.post("/v1/completions", json=completion())
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_fastapi_422_becomes_openai_400(client: TestClient) -> None:
    """Routes parse their bodies themselves; FastAPI's own validation error still answers 400, not 422."""
    handler = client.app.exception_handlers[RequestValidationError]  # type: ignore[attr-defined]
    error = RequestValidationError(
        [{"loc": ("body", "messages", 0, "role"), "msg": "bad role", "type": "literal_error"}]
    )
    reply = asyncio.run(handler(None, error))
    assert reply.status_code == 400
    assert json.loads(reply.body)["error"] == {
        "message": "messages.[0].role: bad role",
        "type": "invalid_request_error",
        "param": "messages.[0].role",
        "code": None,
    }


def test_overloaded_router_gives_429_with_retry_after(client: TestClient, ingress: TinyIngress) -> None:
    ingress.max_active = 0
    try:
        response = client.post("/v1/completions", json=completion())
        streamed = client.post("/v1/chat/completions", json=chat(stream=True))
    finally:
        ingress.max_active = 8
    for r in (response, streamed):
        assert r.status_code == 429
        assert r.headers["retry-after"] == "2"
        assert r.json()["error"]["type"] == "rate_limit_exceeded"
    assert client.post("/v1/completions", json=completion()).status_code == 200


def sse(text: str) -> list[dict[str, Any]]:
    """Parse an SSE body: every event is one `data:` line and a blank line; the last is [DONE]."""
    events = text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", text[-200:]
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1])
    return [json.loads(e[len("data: ") :]) for e in events[:-2]]


def test_completion_is_the_targets_greedy_output_streamed_or_not(client: TestClient, models, tokenizer) -> None:
    prompt = tokenizer.encode("the quick brown fox")
    body = completion(prompt="the quick brown fox", max_tokens=12, ignore_eos=True, return_token_ids=True)
    full = client.post("/v1/completions", json=body).json()
    assert full["object"] == "text_completion" and full["model"] == MODEL_NAME and full["id"].startswith("cmpl-")
    (choice,) = full["choices"]
    assert choice["token_ids"] == reference_greedy(models[0], prompt, 12)
    assert choice["text"] == tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    usage = full["usage"]
    assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] == 12
    assert usage["total_tokens"] == len(prompt) + 12
    assert usage["draft_tokens"] >= usage["accepted_tokens"] >= 0 and usage["acceptance_length"] >= 1.0

    response = client.post("/v1/completions", json=body | {"stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    chunks = sse(response.text)
    *token_chunks, usage_chunk = chunks
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert [t for c in token_chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    assert "".join(c["choices"][0]["text"] for c in token_chunks) == choice["text"]
    assert [c["choices"][0]["finish_reason"] for c in token_chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in token_chunks[:-1])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12


def test_max_draft_tokens_zero_turns_speculation_off_for_that_request(client: TestClient, models, tokenizer) -> None:
    prompt = tokenizer.encode("the quick brown fox")
    body = completion(prompt="the quick brown fox", max_tokens=12, ignore_eos=True, return_token_ids=True)
    on = client.post("/v1/completions", json=body).json()
    off = client.post("/v1/completions", json=body | {"max_draft_tokens": 0}).json()
    assert on["usage"]["draft_tokens"] > 0  # the deployment speculates ...
    assert off["usage"]["draft_tokens"] == 0 and off["usage"]["acceptance_length"] == 1.0  # ... not for this one
    assert off["choices"][0]["token_ids"] == on["choices"][0]["token_ids"] == reference_greedy(models[0], prompt, 12)


def test_chat_stream_adds_up_to_the_chat_response(client: TestClient, tokenizer) -> None:
    body = chat(max_tokens=10, ignore_eos=True, return_token_ids=True)
    full = client.post("/v1/chat/completions", json=body).json()
    assert full["object"] == "chat.completion" and full["id"].startswith("chatcmpl-")
    message = full["choices"][0]["message"]
    assert message["role"] == "assistant"
    chunks = sse(client.post("/v1/chat/completions", json=body | {"stream": True}).text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == message["content"]
    assert [t for c in chunks for t in c["choices"][0].get("token_ids") or []] == full["choices"][0]["token_ids"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_string_cuts_text_in_both_modes(client: TestClient) -> None:
    base = completion(prompt="the quick brown fox", max_tokens=12, ignore_eos=True)
    text = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    stop = text.split()[2]  # a word the model does produce
    cut = client.post("/v1/completions", json=base | {"stop": stop}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == text[: text.index(stop)]
    chunks = sse(client.post("/v1/completions", json=base | {"stop": [stop], "stream": True}).text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == cut["text"]


def test_models_and_health(client: TestClient) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL_NAME]
    assert models["data"][0]["max_model_len"] == WINDOW
    assert client.get("/health", headers={"Authorization": ""}).json()["status"] == "ok"


# ---- the official openai client over a real socket ------------------------------------------------
@pytest.fixture(scope="module")
def server(ingress: TinyIngress) -> Iterator[str]:
    with serve_in_thread(ingress.__serve_build_asgi_app__()) as url:
        yield url + "/v1"


def test_openai_client(server: str, ingress: TinyIngress) -> None:
    client = openai.OpenAI(base_url=server, api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == [MODEL_NAME]

    done = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=6, temperature=0)
    assert done.choices[0].finish_reason in ("stop", "length") and done.usage is not None
    assert done.usage.model_extra is not None and done.usage.model_extra["acceptance_length"] >= 1.0

    messages: list[Any] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there !"}]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens  # type: ignore[union-attr]

    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL_NAME, prompt="hello", temperature=5)
    assert bad.value.param == "temperature"  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hello")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server, api_key="sk-wrong", max_retries=0).models.list()


def test_openai_client_sees_429_while_the_router_is_full(server: str, ingress: TinyIngress) -> None:
    client = openai.OpenAI(base_url=server, api_key=KEY, max_retries=0, timeout=60)
    ingress.max_active = 1
    try:
        holder = client.completions.create(
            model=MODEL_NAME, prompt="one two", max_tokens=WINDOW - 3, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(holder))  # admitted: the router is full until this stream ends
        with pytest.raises(openai.RateLimitError) as full:
            client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=2)
        assert full.value.response.headers["retry-after"] == "2"
        holder.close()  # a client that goes away: the router frees its sequence
        deadline = time.monotonic() + 30
        while ingress.active and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ingress.active == 0
    finally:
        ingress.max_active = 8
    assert client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=2).choices


def test_health_is_503_while_the_target_pool_is_silent(
    client: TestClient, ingress: TinyIngress, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def silent() -> dict[str, Any]:
        raise TimeoutError("target pool did not answer")

    monkeypatch.setattr(ingress, "info", silent)
    response = client.get("/health")
    assert response.status_code == 503 and response.json()["error"]["code"] == "not_ready"


@pytest.mark.parametrize("n", [1, 3])
def test_a_failure_mid_stream_ends_the_stream_with_an_error_event(
    client: TestClient, ingress: TinyIngress, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    real = ingress.generate_stream

    async def failing(prompt: list[int], sampling: dict[str, Any] | None = None) -> Any:
        async with contextlib.aclosing(real(prompt, sampling)) as stream:  # as the router: its finally runs
            async for chunk in stream:
                yield chunk
                raise RuntimeError("target pool unavailable")

    monkeypatch.setattr(ingress, "generate_stream", failing)
    response = client.post("/v1/completions", json=completion(max_tokens=20, ignore_eos=True, stream=True, n=n))
    assert response.status_code == 200
    *tokens, error, done = response.text.split("\n\n")[:-1]
    assert tokens and done == "data: [DONE]" and "target pool unavailable" in json.loads(error[6:])["error"]["message"]
    assert ingress.active == 0  # the router's streams were closed: every choice's sequence is gone


def test_detokenizer_holds_back_what_may_start_a_stop_string() -> None:
    detok = Detokenizer(lambda ids: "".join(map(chr, ids)), stop=("ab",))
    pushes = [([ord("x")], None, "x"), ([ord("a")], None, ""), ([ord("c")], None, "ac"), ([ord("a")], None, "")]
    for ids, reason, expected in pushes:
        assert detok.push(ids, reason) == expected
    assert detok.push([ord("b")], "stop") == ""  # "xaca" + "b": cut before the stop string
    utf8 = Detokenizer(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    assert utf8.push([0xC3]) == "" and utf8.push([0xA9]) == "é"
