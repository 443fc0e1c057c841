"""Structured output on the OpenAI HTTP API: `response_format` and vLLM's guided fields -> a grammar.

OpenAI's `response_format` ({"type": "json_object"}, {"type": "json_schema", "json_schema":
{"name", "schema", "strict"}}; {"type": "text"} asks nothing) on chat, and on completions as vLLM
accepts it. vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs`
({"json" | "regex" | "choice" | "json_object" | "grammar": ...}) map to the same `GrammarSpec`; a grammar is
GBNF (`root ::= ...`, as vLLM's xgrammar backend takes it) or Lark (llguidance's syntax). At most one of them per
request. A grammar llguidance cannot compile is a 400 naming the field it came from; the check
needs no tokenizer, so the front door makes it before the request reaches a worker.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Literal

from llguidance.gbnf_to_lark import any_to_lark
from pydantic import BaseModel, ConfigDict, Field

from deploy.front.frontdoor import RequestError
from speculative.rules.grammar import grammar_error
from speculative.rules.sampling import GrammarSpec

REQUEST_MODEL = ConfigDict(extra="allow", strict=True, allow_inf_nan=False, frozen=True)


class JsonSchemaFormat(BaseModel):
    model_config = REQUEST_MODEL

    name: str = Field(max_length=64, description="The schema's name; accepted, not shown to the model.")
    description: str | None = Field(default=None, description="Accepted, not shown to the model.")
    schema_: dict[str, Any] | None = Field(default=None, alias="schema", description="The JSON schema; none: any JSON.")
    strict: bool | None = Field(default=None, description="Accepted: the output always follows the schema.")


class ResponseFormat(BaseModel):
    model_config = REQUEST_MODEL

    type: Literal["text", "json_object", "json_schema"] = Field(description="text: no constraint.")
    json_schema: JsonSchemaFormat | None = Field(default=None, description="With type json_schema.")


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one of its constraints."""

    model_config = REQUEST_MODEL

    json_: dict[str, Any] | str | None = Field(default=None, alias="json", description="A JSON schema.")
    regex: str | None = Field(default=None, description="A regular expression the output matches.")
    choice: list[str] | None = Field(default=None, min_length=1, description="The output is one of these.")
    json_object: bool | None = Field(default=None, description="Any JSON object.")
    grammar: str | None = Field(default=None, description="A grammar: GBNF (`root ::= ...`) or Lark.")
    structural_tag: Any = Field(default=None, description="Refused: structural tags are not supported.")


def _schema_spec(schema: dict[str, Any] | str | None, param: str) -> GrammarSpec:
    if schema is None:
        return GrammarSpec(kind="json_object")
    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        return GrammarSpec(kind="json_schema", text=text)
    except ValueError as e:
        raise RequestError(f"{param}: {str(e).removeprefix('grammar: ')}", param=param) from None


def _choice_spec(choices: list[str]) -> GrammarSpec:
    return GrammarSpec(kind="regex", text="|".join(f"({re.escape(c)})" for c in choices))


def _from_response_format(fmt: ResponseFormat) -> GrammarSpec | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec(kind="json_object")
    if fmt.json_schema is None:
        param = "response_format.json_schema"
        raise RequestError(f"{param}: required with type json_schema", param=param)
    return _schema_spec(fmt.json_schema.schema_ or {}, "response_format")


def _grammar_spec(text: str, param: str) -> GrammarSpec:
    """vLLM's grammar fields: GBNF (`root ::= ...`, what its xgrammar backend takes) as llguidance converts it, or
    a Lark grammar (llguidance's own syntax)."""
    try:
        lark = any_to_lark(text)
    except Exception as e:  # the converter raises bare Exceptions too ("Rule 'x' not found")
        raise RequestError(f"{param}: the grammar does not compile: {e}", param=param) from None
    try:
        return GrammarSpec(kind="lark", text=lark)
    except ValueError as e:
        raise RequestError(f"{param}: {str(e).removeprefix('grammar: ')}", param=param) from None


def _from_structured_outputs(so: StructuredOutputs) -> GrammarSpec | None:
    if so.structural_tag is not None:
        param = "structured_outputs.structural_tag"
        raise RequestError(f"{param}: not supported by this server", param=param)
    asked = [k for k in ("json_", "regex", "choice", "json_object", "grammar") if getattr(so, k) not in (None, False)]
    if len(asked) > 1:
        raise RequestError("structured_outputs: at most one constraint", param="structured_outputs")
    if so.json_ is not None:
        return _schema_spec(so.json_, "structured_outputs")
    if so.regex is not None:
        return GrammarSpec(kind="regex", text=so.regex) if so.regex else None
    if so.choice is not None:
        return _choice_spec(so.choice)
    if so.grammar is not None:
        return _grammar_spec(so.grammar, "structured_outputs.grammar")
    return GrammarSpec(kind="json_object") if so.json_object else None


def request_grammar(
    request: Any, unavailable: Callable[[], str | None], tools: GrammarSpec | None = None
) -> tuple[dict[str, Any] | None, str | None]:
    """The request's grammar as a SamplingParams `grammar` dict, and the field it came from (None, None:
    no constraint). `tools`: the calls a `tool_choice` of required or a function asks for (deploy/openai/tools.py).
    RequestError naming the field for two constraints, one llguidance cannot compile, or
    any when `unavailable()` says why this model cannot have one (`GrammarCompiler.unavailable`)."""
    found: list[tuple[str, GrammarSpec]] = [("tool_choice", tools)] if tools is not None else []
    if request.response_format is not None and (spec := _from_response_format(request.response_format)):
        found.append(("response_format", spec))
    if request.guided_json is not None:
        found.append(("guided_json", _schema_spec(request.guided_json, "guided_json")))
    if request.guided_regex:
        found.append(("guided_regex", GrammarSpec(kind="regex", text=request.guided_regex)))
    if request.guided_choice:
        found.append(("guided_choice", _choice_spec(request.guided_choice)))
    if request.guided_grammar:
        found.append(("guided_grammar", _grammar_spec(request.guided_grammar, "guided_grammar")))
    if request.structured_outputs is not None and (spec := _from_structured_outputs(request.structured_outputs)):
        found.append(("structured_outputs", spec))
    if not found:
        return None, None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise RequestError(f"{found[1][0]}: at most one structured output constraint (got {names})", found[1][0])
    param, spec = found[0]
    error = grammar_error(spec)
    if error is not None:
        raise RequestError(f"{param}: the grammar does not compile: {error}", param=param)
    reason = unavailable()
    if reason is not None:
        raise RequestError(f"{param}: structured output is not available for this model: {reason}", param=param)
    return spec.model_dump(), param
