"""Tool calls read out of output text (deploy/openai/tools.py), whole and streamed, and the grammar of required and
named calls over the Qwen tokenizer: what it lets through is exactly calls of the given tools."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import pytest
from transformers import AutoTokenizer

from deploy.front.frontdoor import RequestError
from deploy.openai.tools import FunctionDefinition, HermesCalls, NamedToolChoice, Tool, tool_use
from speculative.rules.grammar import GrammarCompiler, grammar_source
from tests.fetched import fetched_dir

NAMES = frozenset({"get_weather", "get_time"})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
BLOCK = '```json\n{\n  "name": "get_time",\n  "arguments": {\n    "timezone": "UTC"\n  }\n}\n```'

# output -> (content, [(name, arguments)])
CASES: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("plain text", "The sky is blue.  ", []),
    ("one call", CALL, [("get_weather", '{"city": "Paris"}')]),
    ("text then two calls", f"Sure.\n{CALL}\n{CALL}", [("get_weather", '{"city": "Paris"}')] * 2),
    ("a call, then text", f"{CALL}\nDone.", [("get_weather", '{"city": "Paris"}')]),
    ("a JSON block naming a tool", BLOCK, [("get_time", '{"timezone": "UTC"}')]),
    ("a bare JSON call", '{"name": "get_time", "arguments": {}}', [("get_time", "{}")]),
    ("a JSON block naming no tool", '```json\n{"name": "other", "arguments": {}}\n```', []),
    ("a JSON block and text", BLOCK + "\nThat is it.", []),
    ("code", "```python\nprint('<tool')\n```", []),
    ("a broken call", '<tool_call>\n{"name": "get_weather", "arg\n</tool_call>', []),
    ("cut off in a call", '<tool_call>\n{"name": "get_weather"', []),
    ("a text marker half way", "a <tool_ca b", []),
]
CONTENT = {
    "plain text": "The sky is blue.  ",
    "one call": "",
    "text then two calls": "Sure.",
    "a call, then text": "Done.",
    "a JSON block naming a tool": "",
    "a bare JSON call": "",
    "a JSON block naming no tool": '```json\n{"name": "other", "arguments": {}}\n```',
    "a JSON block and text": BLOCK + "\nThat is it.",
    "code": "```python\nprint('<tool')\n```",
    "a broken call": '<tool_call>\n{"name": "get_weather", "arg\n</tool_call>',
    "cut off in a call": '<tool_call>\n{"name": "get_weather"',
    "a text marker half way": "a <tool_ca b",
}


@pytest.mark.parametrize("step", [1, 3, 7, 10_000])
@pytest.mark.parametrize(("name", "text", "calls"), CASES, ids=[c[0] for c in CASES])
def test_calls_and_content_are_the_same_however_the_text_streams(
    name: str, text: str, calls: list[tuple[str, str]], step: int
) -> None:
    reader = HermesCalls(NAMES)
    content, found = "", []
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for k, piece in enumerate(pieces):
        parsed = reader.feed(piece, final=k == len(pieces) - 1)
        content += parsed.content
        found += parsed.calls
    assert content == CONTENT[name]
    assert [(c.function.name, c.function.arguments) for c in found] == calls
    assert reader.made == len(calls)
    assert len({c.id for c in found}) == len(found)


def test_one_call_is_kept_where_parallel_calls_are_off() -> None:
    parsed = HermesCalls(NAMES, parallel=False).feed(f"{CALL}\n{CALL}", final=True)
    assert len(parsed.calls) == 1 and parsed.content == ""


def _tools(*names: str) -> list[Tool]:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    return [Tool(type="function", function=FunctionDefinition(name=n, parameters=schema)) for n in names]


Qwen = tuple[Any, GrammarCompiler]  # the HF tokenizer and its grammar compiler


@pytest.fixture(scope="module")
def qwen() -> Qwen:
    tokenizer = AutoTokenizer.from_pretrained(str(fetched_dir("qwen-1.5b")))
    return tokenizer, GrammarCompiler.from_hf(tokenizer)


def _accepts(qwen: Qwen, spec: Any, text: str) -> bool:
    """Whether the grammar lets the Qwen tokenizer's ids of `text` through, and may end after them."""
    tokenizer, grammars = qwen
    matcher = llguidance.LLMatcher(grammars.tokenizer, grammar_source(spec), log_level=0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def test_required_and_named_grammars_let_through_exactly_calls_of_the_tools(qwen: Qwen) -> None:
    def call(name: str, arguments: Any) -> str:
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"

    required = tool_use(_tools("a", "b"), "required", None, "hermes")
    assert required is not None and required.grammar is not None
    assert _accepts(qwen, required.grammar, call("a", {"x": 1}))
    assert _accepts(qwen, required.grammar, call("a", {"x": 1}) + "\n" + call("b", {"x": 2}))
    assert not _accepts(qwen, required.grammar, call("c", {"x": 1}))  # no such tool
    assert not _accepts(qwen, required.grammar, call("a", {"x": "one"}))  # not its schema
    assert not _accepts(qwen, required.grammar, "Hello " + call("a", {"x": 1}))  # text is no call
    single = tool_use(_tools("a", "b"), "required", False, "hermes")
    assert single is not None and single.grammar is not None
    assert not _accepts(qwen, single.grammar, call("a", {"x": 1}) + "\n" + call("b", {"x": 2}))
    b = NamedToolChoice.model_validate({"type": "function", "function": {"name": "b"}})
    named = tool_use(_tools("a", "b"), b, None, "hermes")
    assert named is not None and named.grammar is not None
    assert _accepts(qwen, named.grammar, call("b", {"x": 1}))
    assert not _accepts(qwen, named.grammar, call("a", {"x": 1}))
    auto = tool_use(_tools("a"), "auto", None, "hermes")
    assert auto is not None and auto.grammar is None and auto.parse
    none = tool_use(_tools("a"), "none", None, "hermes")
    assert none is not None and not none.parse and none.tools  # the template still lists them


def test_tools_a_model_cannot_call_are_refused_naming_the_field() -> None:
    with pytest.raises(RequestError, match="tool_call_parser") as e:
        tool_use(_tools("a"), "auto", None, None)
    assert e.value.param == "tools"
    bad = [Tool(type="function", function=FunctionDefinition(name="a", parameters={"type": "strin"}))]
    with pytest.raises(RequestError) as e:
        tool_use(bad, "required", None, "hermes")
    assert e.value.param == "tools"
