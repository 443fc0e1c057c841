"""What clients written for OpenAI or vLLM expect, through the official `openai` client over a real socket.

The HTTP front door over the tiny in-process router (tests/front_router.py): `n` choices seeded
apart (reproducible with a seed), batches of prompts, `echo`, `include_stop_str_in_output`,
`skip_special_tokens`, `chat_template_kwargs`; unknown fields ignored and named (or refused, as
configured); GET /v1/models/{id}; vLLM's /tokenize and /detokenize.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import requests
from pydantic import ValidationError

from deploy.front.frontdoor import FrontDoorConfig
from deploy.openai.unknown_fields import IGNORED_HEADER
from tests.front_router import (
    CHAT_TEMPLATE,
    MODEL_NAME,
    TinyIngress,
    front_door,
    serve_in_thread,
    tiny_pair,
    tiny_tokenizer,
)
from tests.tiny_models import VOCAB

KEY = "sk-compat"
WINDOW = 64
PROMPT = "the quick brown fox"  # greedy: "the there routes green replica ..."
SPECIAL_PROMPT = "one two three"  # greedy: ", world <|user|> big world <|user|> ...": a special token early
MESSAGES: list[Any] = [{"role": "user", "content": "hello there !"}]
THINKING = " one two three"  # what the test template adds with enable_thinking
SAMPLED: dict[str, Any] = {"temperature": 1.0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def models():
    return tiny_pair()


@pytest.fixture(scope="module")
def tokenizer():
    """The tests' tokenizer, its chat template with a variable (as Qwen3's `enable_thinking`)."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE + "{% if enable_thinking %}" + THINKING + "{% endif %}"
    return tokenizer


def tiny_ingress(models: Any, tokenizer: Any, **config: Any) -> TinyIngress:
    return TinyIngress(front_door(tokenizer, WINDOW, api_key=KEY, **config), *models)


@pytest.fixture(scope="module")
def ingress(models, tokenizer) -> TinyIngress:
    return tiny_ingress(models, tokenizer)


@pytest.fixture(scope="module")
def server(ingress: TinyIngress) -> Iterator[str]:
    with serve_in_thread(ingress.__serve_build_asgi_app__()) as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


def post(server: str, path: str, body: dict[str, Any], key: str = KEY) -> requests.Response:
    return requests.post(server + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


# ---- n, batches, echo ------------------------------------------------------------------------------
def test_n_choices_with_a_seed_reproduce_and_differ(client: openai.OpenAI) -> None:
    first = client.completions.create(model=MODEL_NAME, prompt="hello world", n=4, seed=7, **SAMPLED)
    again = client.completions.create(model=MODEL_NAME, prompt="hello world", n=4, seed=7, **SAMPLED)
    alone = client.completions.create(model=MODEL_NAME, prompt="hello world", seed=7, **SAMPLED)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert texts == [c.text for c in again.choices]  # seeded: the same four choices on every run
    assert len(set(texts)) == 4  # each choice has a seed of its own
    assert texts[0] == alone.choices[0].text  # choice 0 is what n = 1 gives
    assert first.usage is not None and alone.usage is not None
    assert first.usage.completion_tokens == 4 * 8 and first.usage.prompt_tokens == alone.usage.prompt_tokens
    assert first.usage.model_extra is not None and first.usage.model_extra["acceptance_length"] >= 1.0
    unseeded = client.completions.create(model=MODEL_NAME, prompt="hello world", n=4, **SAMPLED)
    assert len({c.text for c in unseeded.choices}) > 1


def test_n_choices_stream_with_their_index_and_sum_their_usage(client: openai.OpenAI) -> None:
    body: dict[str, Any] = {"model": MODEL_NAME, "messages": MESSAGES, "n": 3, "seed": 11} | SAMPLED
    full = client.chat.completions.create(**body)
    texts: dict[int, str] = defaultdict(str)
    roles, usage = set(), None
    for chunk in client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            roles |= {c.index} if c.delta.role == "assistant" else set()
        usage = chunk.usage or usage
    assert dict(texts) == {c.index: c.message.content for c in full.choices} and len(texts) == 3
    assert roles == {0, 1, 2}  # each choice's first chunk carries the role
    assert usage is not None and full.usage is not None
    assert usage.completion_tokens == full.usage.completion_tokens == 3 * 8


def test_a_client_that_leaves_mid_stream_frees_every_choice(client: openai.OpenAI, ingress: TinyIngress) -> None:
    stream = client.completions.create(
        model=MODEL_NAME, prompt="hello world", n=3, stream=True, max_tokens=WINDOW - 3, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    assert ingress.active == 3  # one sequence per choice
    stream.close()
    deadline = time.monotonic() + 30
    while ingress.active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ingress.active == 0


def test_a_batch_of_prompts_gives_its_choices_in_order(client: openai.OpenAI, tokenizer: Any) -> None:
    prompts = [PROMPT, SPECIAL_PROMPT]
    alone = [client.completions.create(model=MODEL_NAME, prompt=p, **GREEDY) for p in prompts]
    batch = client.completions.create(model=MODEL_NAME, prompt=prompts, n=2, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]  # prompt_index * n + i
    assert [c.text for c in batch.choices] == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert batch.usage is not None and batch.usage.prompt_tokens == 4 + 3  # each prompt once
    assert batch.usage.completion_tokens == 4 * 6
    by_ids = client.completions.create(model=MODEL_NAME, prompt=[tokenizer.encode(p) for p in prompts], **GREEDY)
    assert [c.text for c in by_ids.choices] == [a.choices[0].text for a in alone]
    streamed: dict[int, str] = defaultdict(str)
    for chunk in client.completions.create(model=MODEL_NAME, prompt=prompts, stream=True, **GREEDY):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert dict(streamed) == {0: alone[0].choices[0].text, 1: alone[1].choices[0].text}
    seeded = client.completions.create(model=MODEL_NAME, prompt=prompts, seed=5, **SAMPLED)
    second = client.completions.create(model=MODEL_NAME, prompt=prompts[1], seed=5, **SAMPLED)
    assert seeded.choices[1].text == second.choices[0].text  # a prompt of a batch gives what it gives alone


def test_echo_puts_the_prompt_before_the_text(client: openai.OpenAI, tokenizer: Any) -> None:
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY).choices[0].text
    echoed = client.completions.create(model=MODEL_NAME, prompt=PROMPT, echo=True, **GREEDY).choices[0].text
    assert echoed == PROMPT + plain
    chunks = client.completions.create(model=MODEL_NAME, prompt=PROMPT, echo=True, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed
    ids = [1, *tokenizer.encode(PROMPT)]  # <s> first: skipped in the echo as in the text
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, echo=True, **GREEDY).choices[0].text
    assert by_ids.startswith(tokenizer.decode(ids, skip_special_tokens=True)) and "<s>" not in by_ids


# ---- output text -----------------------------------------------------------------------------------
def test_include_stop_str_in_output_keeps_the_stop(client: openai.OpenAI, tokenizer: Any) -> None:
    greedy = GREEDY | {"max_tokens": 12}
    text = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **greedy).choices[0].text
    stop = text.split()[2]
    at = text.index(stop)
    cut = client.completions.create(model=MODEL_NAME, prompt=PROMPT, stop=stop, **greedy).choices[0]
    keep = {"include_stop_str_in_output": True, "ignore_eos": True}
    kept = client.completions.create(model=MODEL_NAME, prompt=PROMPT, stop=stop, **greedy | {"extra_body": keep})
    assert cut.finish_reason == "stop" and cut.text == text[:at]
    assert kept.choices[0].text == text[: at + len(stop)]
    chunks = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, stop=stop, stream=True, **greedy | {"extra_body": keep}
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == kept.choices[0].text
    # A stop token is no part of the text either (as in vLLM), unless kept: "," then "world".
    world = {"stop_token_ids": tokenizer.encode("world")}
    by_token = client.completions.create(model=MODEL_NAME, prompt=SPECIAL_PROMPT, **GREEDY | {"extra_body": world})
    kept_token = client.completions.create(
        model=MODEL_NAME, prompt=SPECIAL_PROMPT, **GREEDY | {"extra_body": world | keep}
    )
    assert by_token.choices[0].finish_reason == "stop"
    assert by_token.choices[0].text == "," and kept_token.choices[0].text == ", world"


def test_skip_special_tokens_false_shows_special_tokens(client: openai.OpenAI, tokenizer: Any) -> None:
    ids_too = {"ignore_eos": True, "return_token_ids": True}
    skipped = client.completions.create(model=MODEL_NAME, prompt=SPECIAL_PROMPT, **GREEDY | {"extra_body": ids_too})
    shown = client.completions.create(
        model=MODEL_NAME, prompt=SPECIAL_PROMPT, **GREEDY | {"extra_body": ids_too | {"skip_special_tokens": False}}
    )
    ids = skipped.choices[0].model_extra["token_ids"]  # type: ignore[index]
    assert ids == shown.choices[0].model_extra["token_ids"]  # type: ignore[index]
    assert "<|user|>" in shown.choices[0].text and "<|user|>" not in skipped.choices[0].text
    assert shown.choices[0].text == tokenizer.decode(ids, skip_special_tokens=False)
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, **GREEDY | {"extra_body": ids_too | {"skip_special_tokens": False}}
    )
    token_ids = chat.choices[0].model_extra["token_ids"]  # type: ignore[index]
    assert chat.choices[0].message.content == tokenizer.decode(token_ids, skip_special_tokens=False)


def test_chat_template_kwargs_reach_the_template(client: openai.OpenAI, tokenizer: Any) -> None:
    short: dict[str, Any] = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    plain = client.chat.completions.create(**short)
    thinking = client.chat.completions.create(**short, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert plain.usage is not None and thinking.usage is not None
    assert thinking.usage.prompt_tokens == plain.usage.prompt_tokens + len(tokenizer.encode(THINKING))


# ---- unknown fields --------------------------------------------------------------------------------
def test_unknown_fields_are_ignored_by_default_and_named(
    client: openai.OpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="deploy.openai.unknown_fields")
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello there !", "cache": 1}], "mood": "ok"}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0, extra_body={"foo": 1, "store": True}
    )
    ignored = {"foo", "store", "messages.[0].mood", "messages.[0].content.[0].cache"}
    assert set(raw.headers[IGNORED_HEADER].split(", ")) == ignored
    reply = raw.parse()
    same = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, temperature=0)
    assert reply.choices[0].message.content == same.choices[0].message.content
    assert any("messages.[0].mood" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    with pytest.raises(openai.BadRequestError) as bad:  # a known field is validated as ever
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, extra_body={"foo": 1, "top_k": "3"})
    assert bad.value.param == "top_k"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as refused:  # an extension that would change the output if ignored
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, extra_body={"structural_tag": {"begin": "<f>"}})
    assert refused.value.param == "structural_tag"  # type: ignore[attr-defined]
    plain = client.completions.with_raw_response.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    assert IGNORED_HEADER not in plain.headers


def test_unknown_fields_are_refused_when_the_deployment_says_so(models: Any, tokenizer: Any) -> None:
    with pytest.raises(ValidationError):
        FrontDoorConfig(served_model_name=MODEL_NAME, unknown_fields="sometimes")  # type: ignore[arg-type]
    strict_ingress = tiny_ingress(models, tokenizer, unknown_fields="reject")
    with serve_in_thread(strict_ingress.__serve_build_asgi_app__()) as url:
        strict = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        asks: list[tuple[dict[str, Any], str]] = [
            ({"messages": MESSAGES, "extra_body": {"foo": 1}}, "foo"),
            ({"messages": [{"role": "user", "content": "hi", "mood": "ok"}]}, "messages.[0].mood"),
            (
                {"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True, "x": 1}},
                "stream_options.x",
            ),
        ]
        for ask, param in asks:
            with pytest.raises(openai.BadRequestError) as bad:
                strict.chat.completions.create(model=MODEL_NAME, max_tokens=2, **ask)
            assert bad.value.param == param  # type: ignore[attr-defined]
            assert "Unrecognized request argument supplied" in str(bad.value)
        assert strict.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2).choices


# ---- endpoints ---------------------------------------------------------------------------------------
def test_model_card_by_id(client: openai.OpenAI) -> None:
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.object == "model"
    assert card.model_extra is not None and card.model_extra["max_model_len"] == WINDOW
    for other in ("gpt-9", "org/tiny-llama"):
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve(other)
        assert missing.value.code == "model_not_found"  # type: ignore[attr-defined]
        assert other in str(missing.value)


def test_tokenize_and_detokenize_round_trip(client: openai.OpenAI, server: str, tokenizer: Any) -> None:
    ids = tokenizer.encode(PROMPT)
    reply = post(server, "/tokenize", {"model": MODEL_NAME, "prompt": PROMPT})
    assert reply.status_code == 200 and reply.json() == {"count": len(ids), "max_model_len": WINDOW, "tokens": ids}
    assert post(server, "/detokenize", {"model": MODEL_NAME, "tokens": ids}).json() == {"prompt": PROMPT}
    assert post(server, "/detokenize", {"tokens": [1, *ids]}).json() == {"prompt": "<s> " + PROMPT}  # as vLLM's
    strs = post(server, "/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()["token_strs"]
    assert strs == PROMPT.split()

    # messages: the ids a chat request runs on, through the same template
    opened = post(server, "/tokenize", {"model": MODEL_NAME, "messages": MESSAGES}).json()["tokens"]
    done = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2, temperature=0)
    assert done.usage is not None and len(opened) == done.usage.prompt_tokens
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert opened == tokenizer.encode(rendered, add_special_tokens=False)
    closed = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()["tokens"]
    assert closed == opened[:-1]  # without the assistant's "<|assistant|>"
    think = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": True}}
    assert post(server, "/tokenize", think).json()["tokens"] == opened + tokenizer.encode(THINKING)

    refusals = [
        ("/detokenize", {"tokens": [5, 9999]}, 400, "tokens.[1]"),
        ("/tokenize", {"model": MODEL_NAME}, 400, "prompt"),
        ("/tokenize", {"prompt": PROMPT, "messages": MESSAGES}, 400, "prompt"),
        ("/tokenize", {"prompt": PROMPT, "add_generation_prompt": True}, 400, "add_generation_prompt"),
        ("/tokenize", {"model": "gpt-9", "prompt": PROMPT}, 404, "model"),
        ("/tokenize", {"prompt": 7}, 400, "prompt"),
    ]
    for path, body, status, param in refusals:
        refused = post(server, path, body)
        assert refused.status_code == status and refused.json()["error"]["param"] == param, refused.text
    assert post(server, "/tokenize", {"prompt": PROMPT}, key="sk-wrong").status_code == 401


def test_structured_output_on_a_tokenizer_without_grammars_is_a_400_and_serves_on(
    client: openai.OpenAI, ingress: TinyIngress
) -> None:
    """The tiny WordLevel tokenizer has no decoder, so llguidance cannot build masks from it: a request
    with a grammar is refused naming its field (before any worker masks by it), and the next is served."""
    constrained: list[dict[str, Any]] = [
        {"response_format": {"type": "json_object"}},
        {"extra_body": {"guided_regex": "[a-z]+"}},
        {"extra_body": {"guided_choice": ["yes", "no"]}},
    ]
    for fields in constrained:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, **fields)
        body: Any = refused.value.body
        assert "structured output is not available for this model" in body["message"], body
        assert body["param"] in ("response_format", "guided_regex", "guided_choice"), body
    done = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **GREEDY)
    assert done.choices[0].finish_reason == "length"
    assert ingress.active == 0, "a refused request left a sequence behind"


def test_suffix_makes_a_fill_in_the_middle_prompt_where_the_tokenizer_has_its_markers(
    client: openai.OpenAI, models: Any
) -> None:
    """With Qwen2.5-Coder's markers in the tokenizer, `suffix` serves the prompt
    `<|fim_prefix|> prompt <|fim_suffix|> suffix <|fim_middle|>`: the same tokens as sending those ids; the
    tiny tokenizer without them refuses `suffix`, naming it."""
    markers = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
    fim_tokenizer = tiny_tokenizer(last=markers)
    fim = TinyIngress(front_door(fim_tokenizer, WINDOW, api_key=KEY), *models)
    with serve_in_thread(fim.__serve_build_asgi_app__()) as url:
        fim_client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        done = fim_client.completions.create(model=MODEL_NAME, prompt=PROMPT, suffix=" over the dog", **GREEDY)
        ids = [fim_tokenizer.convert_tokens_to_ids(m) for m in markers]
        assert ids == [VOCAB - 3, VOCAB - 2, VOCAB - 1]
        expected_prompt = [
            ids[0],
            *fim_tokenizer.encode(PROMPT),
            ids[1],
            *fim_tokenizer.encode(" over the dog"),
            ids[2],
        ]
        by_ids = fim_client.completions.create(model=MODEL_NAME, prompt=expected_prompt, **GREEDY)
        assert done.usage is not None and done.usage.prompt_tokens == len(expected_prompt)
        assert done.choices[0].text == by_ids.choices[0].text
        echoed = fim_client.completions.create(
            model=MODEL_NAME, prompt=fim_tokenizer.encode(PROMPT), suffix=" over the dog", echo=True, **GREEDY
        )
        assert echoed.choices[0].text == PROMPT + done.choices[0].text  # the prompt alone, not the suffix
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, suffix=" over the dog", **GREEDY)
    body: Any = refused.value.body
    assert body["param"] == "suffix" and "fill-in-the-middle" in body["message"], body


def test_continue_final_message_continues_the_assistants_prefill(client: openai.OpenAI, tokenizer: Any) -> None:
    """vLLM's `continue_final_message` with `add_generation_prompt: false`: the prompt is the conversation with
    the assistant's last message left open (HF's template render), and the output continues it, as a completion
    of those prompt ids does; either flag alone in the wrong place is a 400 naming it."""
    messages = [*MESSAGES, {"role": "assistant", "content": "the quick"}]
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    rendered = tokenizer.apply_chat_template(
        messages, tokenize=False, continue_final_message=True, add_generation_prompt=False
    )
    assert rendered.endswith("the quick"), "the prefill is left open"
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    done = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0, extra_body=flags | {"ignore_eos": True}
    )
    assert done.usage is not None and done.usage.prompt_tokens == len(ids)
    same = client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert done.choices[0].message.content == same.choices[0].text
    for extra, why in (
        ({"continue_final_message": True}, "add_generation_prompt"),
        (flags, "assistant"),  # the last message is the user's
    ):
        with pytest.raises(openai.BadRequestError) as bad:
            last = messages if why != "assistant" else MESSAGES
            client.chat.completions.create(model=MODEL_NAME, messages=last, max_tokens=2, extra_body=extra)
        assert bad.value.param == "continue_final_message" and why in str(bad.value), bad.value  # type: ignore[attr-defined]


def test_per_request_spec_decode_metrics_under_vllms_names(client: openai.OpenAI, models: Any, tokenizer: Any) -> None:
    """`front_door.per_request_spec_decode_metrics`: each response (and a stream's usage chunk) carries vLLM's
    `metrics.speculative_decoding`, agreeing with its usage and with itself; off by default."""
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0)
    assert "metrics" not in (plain.model_extra or {}), "off by default, the response as before"
    ingress = tiny_ingress(models, tokenizer, per_request_spec_decode_metrics=True)
    with serve_in_thread(ingress.__serve_build_asgi_app__()) as url:
        measured = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        body: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
        done = measured.completions.create(**body, n=2, extra_body={"ignore_eos": True})
        chunks = list(
            measured.completions.create(
                **body, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
            )
        )
    for usage, metrics in (
        (done.usage, done.model_extra["metrics"]),
        (chunks[-1].usage, chunks[-1].model_extra["metrics"]),
    ):
        spec = metrics["speculative_decoding"]
        assert usage is not None and spec["num_draft_tokens"] == usage.model_extra["draft_tokens"] > 0
        assert spec["num_accepted_draft_tokens"] == usage.model_extra["accepted_tokens"]
        histogram = spec["acceptance_histogram"]
        assert sum(histogram) == spec["num_spec_steps"] > 0
        assert sum(j * count for j, count in enumerate(histogram)) == spec["num_accepted_draft_tokens"]
        assert spec["mean_acceptance_length"] == 1 + spec["num_accepted_draft_tokens"] / spec["num_spec_steps"]
        assert spec["draft_acceptance_rate"] == spec["num_accepted_draft_tokens"] / spec["num_draft_tokens"]
        assert spec["num_spec_tokens"] >= len(histogram) - 1


# ---- Predicted Outputs ------------------------------------------------------------------------------
def test_a_prediction_changes_no_token_and_its_tokens_are_counted(client: openai.OpenAI, tokenizer: Any) -> None:
    body: dict[str, Any] = {"model": MODEL_NAME, "messages": MESSAGES, "temperature": 0.0, "max_tokens": 12}
    extra = {"ignore_eos": True, "return_token_ids": True}
    alone = client.chat.completions.create(**body, extra_body=extra)
    text = alone.choices[0].message.content or ""
    assert alone.usage is not None and alone.usage.completion_tokens_details is None  # asked no prediction
    ids = tokenizer.encode(text, add_special_tokens=False)
    for prediction, accepted in ((text, len(ids)), ("red green blue yellow", None)):
        fields = body | {"prediction": {"type": "content", "content": prediction}}
        reply = client.chat.completions.create(**fields, extra_body=extra)
        assert reply.choices[0].message.content == text  # drafts only: the same output
        assert reply.usage is not None and reply.usage.completion_tokens_details is not None
        details = reply.usage.completion_tokens_details
        total = len(tokenizer.encode(prediction, add_special_tokens=False))
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == total
        if accepted is not None:  # the output itself, predicted: every token repeated
            assert details.accepted_prediction_tokens == accepted
        chunks = client.chat.completions.create(
            **fields, extra_body=extra, stream=True, stream_options={"include_usage": True}
        )
        streamed = [c for c in chunks]
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
        assert streamed[-1].usage is not None and streamed[-1].usage.completion_tokens_details == details
    with pytest.raises(openai.BadRequestError, match="prediction"):
        client.chat.completions.create(**body, prediction={"type": "content", "content": "one two " * 40})
