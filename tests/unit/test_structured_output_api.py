"""Structured output through the official `openai` client: `response_format` and vLLM's guided fields.

The HTTP front door over the in-process router (tests/front_router.py) serving SmolLM2-135M with a
noisy copy of itself drafting: the tiny WordLevel tokenizer has no `{` or `"`, so JSON needs a
real one. Greedy json_schema output validates; with speculation it is what plain decoding
(`max_draft_tokens: 0`) emits; a schema llguidance cannot compile is a 400 naming the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from speculative.rules.grammar import GrammarCompiler
from tests.fetched import fetched_dir
from tests.front_router import MODEL_NAME, TinyIngress, front_door, serve_in_thread
from tests.tiny_models import noisy_copy

pytestmark = pytest.mark.slow

KEY = "sk-structured"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0, "maximum": 99_999_999},  # a small model repeats digits
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}
MESSAGES: list[Any] = [{"role": "user", "content": "Name the largest city in France and its population, as JSON."}]


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    folder = str(fetched_dir("smollm2-135m"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype="float32").eval()
    grammars = GrammarCompiler.from_hf(tokenizer)
    ingress = TinyIngress(front_door(tokenizer, 2048, api_key=KEY), target, noisy_copy(target, 0.02), grammars=grammars)
    with serve_in_thread(ingress.__serve_build_asgi_app__()) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}


def test_chat_json_schema_validates_and_equals_plain_decoding(client: openai.OpenAI) -> None:
    fields: dict[str, Any] = {"model": MODEL_NAME, "messages": MESSAGES, "temperature": 0, "max_tokens": 60}
    reply = client.chat.completions.create(**fields, response_format=_schema_format(SCHEMA))  # type: ignore[arg-type]
    text = reply.choices[0].message.content or ""
    print("json_schema:", text, "usage:", reply.usage)
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    plain = client.chat.completions.create(
        **fields,
        response_format=_schema_format(SCHEMA),  # type: ignore[arg-type]
        extra_body={"max_draft_tokens": 0},
    )
    assert plain.choices[0].message.content == text


def test_completions_take_response_format_and_guided_fields(client: openai.OpenAI) -> None:
    fields: dict[str, Any] = {"model": MODEL_NAME, "prompt": "A JSON object about a cat:", "temperature": 0}
    obj = client.completions.create(**fields, max_tokens=40, extra_body={"response_format": {"type": "json_object"}})
    assert obj.choices[0].finish_reason == "stop", obj.choices[0].text
    assert isinstance(json.loads(obj.choices[0].text), dict)
    regex = client.completions.create(**fields, max_tokens=20, extra_body={"guided_regex": "[0-9]{3}-[a-z]{2,4}"})
    assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", regex.choices[0].text), regex.choices[0].text
    choice = client.completions.create(**fields, max_tokens=10, extra_body={"guided_choice": ["purr", "hiss"]})
    assert choice.choices[0].text in ("purr", "hiss")
    vllm = client.completions.create(
        **fields, max_tokens=10, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert vllm.choices[0].text in ("yes", "no")
    schema = client.completions.create(**fields, max_tokens=60, extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(schema.choices[0].text), SCHEMA)


@pytest.mark.parametrize(
    "extra",
    [
        {"guided_grammar": 'root ::= "mood: " mood "."\nmood ::= "calm" | "cross" | "sleepy"'},  # GBNF (xgrammar's)
        {"guided_grammar": 'start: "mood: " mood "."\nmood: "calm" | "cross" | "sleepy"'},  # Lark (llguidance's)
        {"structured_outputs": {"grammar": 'root ::= "mood: " ("calm" | "cross" | "sleepy") "."'}},
    ],
    ids=["gbnf", "lark", "structured-outputs"],
)
def test_a_grammar_shapes_the_output_and_speculation_does_not_change_it(
    client: openai.OpenAI, extra: dict[str, Any]
) -> None:
    fields: dict[str, Any] = {"model": MODEL_NAME, "prompt": "The cat's mood:", "temperature": 0, "max_tokens": 12}
    done = client.completions.create(**fields, extra_body=extra)
    assert re.fullmatch(r"mood: (calm|cross|sleepy)\.", done.choices[0].text), done.choices[0].text
    assert done.choices[0].finish_reason == "stop"
    plain = client.completions.create(**fields, extra_body=extra | {"max_draft_tokens": 0})
    assert plain.choices[0].text == done.choices[0].text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": _schema_format({"type": "nonsense"})}, "response_format"),
        ({"response_format": _schema_format({"type": "string", "minLength": 5, "maxLength": 2})}, "response_format"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex"),
        ({"guided_grammar": 'root ::= "a" missing'}, "guided_grammar"),
        ({"guided_grammar": "start: (unclosed"}, "guided_grammar"),
        ({"structured_outputs": {"grammar": "root ::= ", "regex": "a"}}, "structured_outputs"),
    ],
)
def test_a_grammar_that_does_not_compile_is_a_400_naming_its_field(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, extra_body=extra)
    assert bad.value.param == param, bad.value  # type: ignore[attr-defined]
