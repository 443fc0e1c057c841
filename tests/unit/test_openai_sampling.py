"""logprobs, penalties, logit_bias, min_p and min_tokens through the official `openai` client, speculation on.

The HTTP front door over the tiny in-process router (tests/front_router.py: a real speculative
decoder, draft model drafting). Each answer with speculation on is compared with the same request
at `max_draft_tokens: 0` (plain decoding): the same tokens, and log probabilities equal to 1e-5.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.front_router import TinyIngress, front_door, serve_in_thread, tiny_pair, tiny_tokenizer

KEY = "sk-sampling"
MODEL = "tiny-llama"
PROMPT = "the quick brown fox"
MESSAGES: list[Any] = [{"role": "user", "content": "hello there !"}]
PLAIN = {"max_draft_tokens": 0}


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    ingress = TinyIngress(front_door(tiny_tokenizer(), 64, api_key=KEY), *tiny_pair())
    with serve_in_thread(ingress.__serve_build_asgi_app__()) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def complete(client: openai.OpenAI, extra: dict[str, Any] | None = None, **fields: Any) -> Any:
    body = {"ignore_eos": True, "return_token_ids": True, **(extra or {})}
    fields = {"temperature": 0.0, "max_tokens": 12} | fields
    return client.completions.create(model=MODEL, prompt=PROMPT, extra_body=body, **fields).choices[0]


def chat(client: openai.OpenAI, extra: dict[str, Any] | None = None, **fields: Any) -> Any:
    body = {"ignore_eos": True, "return_token_ids": True, **(extra or {})}
    fields = {"temperature": 0.0, "max_tokens": 12} | fields
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=body, **fields).choices[0]


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) < 1e-5 for x, y in zip(a, b, strict=True))


def test_completion_logprobs_equal_plain_decoding(client):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, temperature=0.0, max_tokens=12, logprobs=3, extra_body={"ignore_eos": True}
    )
    assert response.usage.accepted_tokens > 0, "no draft token accepted: the comparison proves nothing"
    spec = complete(client, logprobs=3)
    plain = complete(client, PLAIN, logprobs=3)
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    lp, base = spec.logprobs, plain.logprobs
    assert lp.tokens == base.tokens and len(lp.tokens) == 12
    assert close(lp.token_logprobs, base.token_logprobs)
    assert all(x <= 0 for x in lp.token_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for top, top_base, token in zip(lp.top_logprobs, base.top_logprobs, lp.tokens, strict=True):
        assert token in top and 3 <= len(top) <= 4  # the three most likely, and the chosen one
        assert top.keys() == top_base.keys() and close(list(top.values()), [top_base[k] for k in top])


def test_chat_logprobs_equal_plain_decoding_and_stream(client):
    spec = chat(client, logprobs=True, top_logprobs=2)
    plain = chat(client, PLAIN, logprobs=True, top_logprobs=2)
    assert spec.message.content == plain.message.content
    content, base = spec.logprobs.content, plain.logprobs.content
    assert [c.token for c in content] == [c.token for c in base] and len(content) == 12
    assert close([c.logprob for c in content], [c.logprob for c in base])
    assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # greedy: the top one is chosen
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0.0, max_tokens=12, logprobs=True, top_logprobs=2, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    streamed = [c for chunk in stream for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert close([c.logprob for c in streamed], [c.logprob for c in content])


def test_no_logprobs_unless_asked(client):
    assert complete(client).logprobs is None
    assert chat(client).logprobs is None


PROCESSED: dict[str, dict[str, Any]] = {
    "penalties": {"presence_penalty": 1.5, "frequency_penalty": 1.0},
    "logit_bias": {"logit_bias": {"7": 6.0, "20": -100.0}},
    "min_p": {"temperature": 0.8, "seed": 5, "extra": {"min_p": 0.2}},
    "min_tokens": {"extra": {"min_tokens": 10, "ignore_eos": False}},
}


@pytest.mark.parametrize("setting", list(PROCESSED))
def test_processors_give_plain_decodings_tokens(client, setting):
    fields = dict(PROCESSED[setting])
    extra = fields.pop("extra", {})
    baseline = complete(client, {"ignore_eos": extra.get("ignore_eos", True)}).token_ids
    spec = complete(client, extra, **fields)
    plain = complete(client, {**extra, **PLAIN}, **fields)
    if setting != "min_p":  # sampled: the tiny router drafts by sampling, so only greedy is token-identical
        assert spec.token_ids == plain.token_ids
    assert spec.token_ids != baseline or setting == "min_tokens"
    if setting == "logit_bias":
        assert 7 in spec.token_ids and 20 not in spec.token_ids
    if setting == "min_tokens":
        assert len(spec.token_ids) >= 10


@pytest.mark.parametrize(
    ("call", "fields", "param"),
    [
        ("complete", {"logit_bias": {"x": 1.0}}, "logit_bias"),
        ("complete", {"logit_bias": {"100000": 1.0}}, "logit_bias"),
        ("complete", {"logit_bias": {"3": 101.0}}, "logit_bias"),
        ("complete", {"presence_penalty": 2.5}, "presence_penalty"),
        ("complete", {"logprobs": 21}, "logprobs"),
        ("complete", {"extra_body": {"min_tokens": 20}, "max_tokens": 5}, "min_tokens"),
        ("complete", {"extra_body": {"min_p": 1.5}}, "min_p"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_bad_values_are_400s_naming_the_field(client, call, fields, param):
    create = client.completions.create if call == "complete" else client.chat.completions.create
    where = {"prompt": PROMPT} if call == "complete" else {"messages": MESSAGES}
    with pytest.raises(openai.BadRequestError) as caught:
        create(model=MODEL, **where, **fields)
    assert caught.value.body["param"] == param, caught.value.body
