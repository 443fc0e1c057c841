"""OpenAI tool calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls` in, `tool_calls` out.

The tools reach the model through its chat template (`tools=`), worded as the model was trained to
see them; its output is read in the tool call format of its family. Hermes-style calls, as Qwen2.5's
template asks for them, are the one format served (`front_door.tool_call_parser`; `auto` takes it
where the template writes `<tool_call>`):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`tool_choice`:
- `auto` (the default with tools): the model writes text or calls; calls are parsed out of the text.
- `required`, or a named function: a grammar (llguidance, as structured output) constrains the output
  to calls of the given tools (of the named one; one call with `parallel_tool_calls: false`), each
  call's arguments following its tool's JSON schema. The grammar masks the drafts too, so
  speculation stays exact: the same tokens as plain decoding.
- `none`: the tools are still shown to the template (as vLLM does by default) and nothing is parsed.

A call whose JSON does not parse stays in the text (`content`), as vLLM's Hermes parser leaves it;
with `parallel_tool_calls: false` only the first call is kept. A choice that made a call finishes
with `tool_calls` instead of `stop`.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from deploy.front.frontdoor import RequestError, marker_start
from deploy.openai.prompts import template_format
from deploy.openai.structured_output import REQUEST_MODEL
from speculative.rules.grammar import JSON_DEFAULTS, grammar_error
from speculative.rules.sampling import GrammarSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"  # Hermes' markers (Qwen2.5: tokens of their own)
_OMIT_NONE: dict[str, Any] = {"exclude_if": lambda v: v is None}


# ---- the request's tools ------------------------------------------------------------------------
class FunctionDefinition(BaseModel):
    model_config = REQUEST_MODEL

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$", description="The function's name.")
    description: str | None = Field(default=None, description="What it does, shown to the model.")
    parameters: dict[str, Any] | None = Field(
        default=None, description="A JSON schema of its arguments (an object); none: no arguments."
    )
    strict: bool | None = Field(default=None, description="Accepted: required and named calls always follow it.")

    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class Tool(BaseModel):
    model_config = REQUEST_MODEL

    type: Literal["function"] = Field(description="Only function tools.")
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = REQUEST_MODEL

    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(BaseModel):
    model_config = REQUEST_MODEL

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# ---- an assistant turn's calls, in a request's messages and in a response -----------------------
class FunctionCall(BaseModel):
    model_config = REQUEST_MODEL

    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(description="The arguments as a JSON object's text.")


class ToolCall(BaseModel):
    model_config = REQUEST_MODEL

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class OutFunctionCall(BaseModel):
    name: str
    arguments: str


class OutToolCall(BaseModel):
    """A call in a response's message."""

    id: str
    type: Literal["function"] = "function"
    function: OutFunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = Field(default=None, **_OMIT_NONE)
    arguments: str | None = Field(default=None, **_OMIT_NONE)


class DeltaToolCall(BaseModel):
    """A call in a stream chunk's delta: each call is sent whole, in one chunk, once its JSON is complete."""

    index: int
    id: str | None = Field(default=None, **_OMIT_NONE)
    type: Literal["function"] | None = Field(default=None, **_OMIT_NONE)
    function: DeltaFunctionCall


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def template_turn_calls(calls: list[ToolCall], param: str) -> list[dict[str, Any]]:
    """An assistant message's calls as chat templates take them: the arguments as an object, not its text
    (Qwen2.5's template writes `arguments | tojson`). RequestError naming a call whose arguments are no object."""
    out = []
    for j, call in enumerate(calls):
        try:
            arguments = json.loads(call.function.arguments)
        except json.JSONDecodeError as e:
            where = f"{param}.tool_calls.[{j}].function.arguments"
            raise RequestError(f"{where}: not JSON: {e}", param=where) from None
        if not isinstance(arguments, dict):
            where = f"{param}.tool_calls.[{j}].function.arguments"
            raise RequestError(f"{where}: must be a JSON object", param=where)
        out.append(
            {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}
        )
    return out


# ---- what a request asks of the tools -------------------------------------------------------------
@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools as the server serves them: what the template is given, how the output is read."""

    tools: list[dict[str, Any]]  # for the chat template's `tools`
    names: frozenset[str]  # the functions'
    parse: bool  # read calls out of the output (tool_choice other than none)
    parallel: bool  # more than one call kept
    grammar: GrammarSpec | None  # required / named: the output is calls only


def tool_use(
    tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None, parser: str | None
) -> ToolUse | None:
    """What `tools`, `tool_choice` and `parallel_tool_calls` ask; None: no tools. `parser`: the model's call format
    (`tool_call_parser`), None where it has none. RequestError naming the field it cannot honour."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise RequestError("tool_choice: names a tool choice but tools is empty or missing", param="tool_choice")
        return None
    if parser is None:
        raise RequestError(
            "tools: this model's chat template has no tool call format this server reads (Hermes-style "
            "<tool_call>): set front_door.tool_call_parser",
            param="tools",
        )
    names = [t.function.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise RequestError(
                f"tools.[{i}].function.name: {name!r} names two tools", param=f"tools.[{i}].function.name"
            )
    choice = choice or "auto"
    kept = tools
    if isinstance(choice, NamedToolChoice):
        kept = [t for t in tools if t.function.name == choice.function.name]
        if not kept:
            known = ", ".join(names)
            message = f"tool_choice.function.name: {choice.function.name!r} is none of the tools ({known})"
            raise RequestError(message, param="tool_choice.function.name")
    multiple = parallel is not False and not isinstance(choice, NamedToolChoice)
    grammar = None if choice in ("auto", "none") else calls_grammar([t.function for t in kept], multiple)
    dumped = [t.model_dump(mode="json", exclude_none=True) for t in tools]
    return ToolUse(dumped, frozenset(names), choice != "none", parallel is not False, grammar)


def calls_grammar(functions: list[FunctionDefinition], multiple: bool) -> GrammarSpec:
    """Output that is Hermes calls of `functions` only (one, or one or more), each's arguments per its schema:
    a Lark grammar whose markers are the tokenizer's `<tool_call>` tokens."""
    bodies = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, "arguments": f.arguments_schema()},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema = (bodies[0] if len(bodies) == 1 else {"anyOf": bodies}) | {"x-guidance": JSON_DEFAULTS}
    start = 'start: call ("\\n" call)*' if multiple else "start: call"
    text = f'{start}\ncall: {OPEN} "\\n" body "\\n" {CLOSE}\nbody: %json {json.dumps(schema)}\n'
    spec = GrammarSpec(kind="lark", text=text)
    if (error := grammar_error(spec)) is not None:  # a tool's parameters llguidance cannot compile
        raise RequestError(f"tools: a tool's parameters do not compile to a grammar: {error}", param="tools")
    return spec


def parser_for(configured: str, chat_template: str | None) -> str | None:
    """The call format of `front_door.tool_call_parser`: `hermes`, or with `auto` where the template writes it."""
    return template_format(configured, chat_template, "hermes", OPEN)


# ---- reading calls out of the output ----------------------------------------------------------------
@dataclass(frozen=True)
class Parsed:
    """What a piece of output holds: text for `content`, and calls completed in it."""

    content: str
    calls: list[OutToolCall]


@dataclass
class HermesCalls:
    """Hermes calls read out of a choice's output text as it streams (`feed` each delta, `final` with the last).

    Text before, between and after calls is content; the whitespace around a call is dropped (Qwen puts a
    newline between calls). A text ending that may be the start of `<tool_call>` or whitespace before one is
    held until the next delta tells. Qwen2.5-Coder writes its calls as a JSON block instead (```json, or bare):
    an output that is, whole, a JSON object naming one of `names` with its arguments (or a list of such) is
    calls too, so an output that begins as one is held until it is known not to be one, or ends."""

    names: frozenset[str]
    parallel: bool = True
    made: int = 0  # calls read so far (and kept)
    _buffer: str = ""
    _in_call: bool = False
    _after_call: bool = False  # the text so far ended with a call: leading whitespace is dropped
    _whole: bool = True  # the output so far may be a JSON block of calls (nothing sent yet)

    def feed(self, text: str, final: bool = False) -> Parsed:
        self._buffer += text
        if self._whole:
            self._whole = _may_be_block(self._buffer)
            if self._whole and not final:
                return Parsed("", [])
            if self._whole and (block := self._block_calls(self._buffer)):
                self._buffer = ""
                return Parsed("", block)
            self._whole = False
        content: list[str] = []
        calls: list[OutToolCall] = []
        while True:
            if self._in_call:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    if final:  # cut off inside a call (max_tokens): its text stays content
                        content.append(self._call_or_text(self._buffer, calls, closed=False))
                        self._buffer, self._in_call = "", False
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE) :]
                self._in_call = False
                content.append(self._call_or_text(body, calls, closed=True))
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                content.append(self._text(self._buffer[:start], before_call=True))
                self._buffer, self._in_call = self._buffer[start + len(OPEN) :], True
                continue
            held = 0 if final else _held(self._buffer)
            content.append(self._text(self._buffer[: len(self._buffer) - held], before_call=False, final=final))
            self._buffer = self._buffer[len(self._buffer) - held :]
            break
        return Parsed("".join(content), calls)

    def _text(self, text: str, before_call: bool, final: bool = False) -> str:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        if before_call or (final and self.made):
            return text.rstrip()
        return text

    def _call_or_text(self, body: str, calls: list[OutToolCall], closed: bool) -> str:
        call = _hermes_call(body)
        if call is None:
            return OPEN + body + (CLOSE if closed else "")
        self._after_call = True
        if self.parallel or self.made == 0:
            self.made += 1
            calls.append(call)
        return ""

    def _block_calls(self, text: str) -> list[OutToolCall]:
        """The calls of a whole output that is a JSON block of them; [] where it is not one."""
        try:
            value = json.loads(_block_json(text))
        except json.JSONDecodeError:
            return []
        objects = value if isinstance(value, list) and value else [value]
        calls = [_call_of(obj) for obj in objects]
        if any(c is None or c.function.name not in self.names for c in calls):
            return []
        kept = [c for c in calls if c is not None][: None if self.parallel else 1]
        self.made = len(kept)
        return kept


FENCE = "```json"


def _block_json(text: str) -> str:
    """The JSON of a ```json block (the text itself where it is bare)."""
    body = text.strip()
    if body.startswith(FENCE):
        body = body[len(FENCE) :].removesuffix("```")
    return body


def _may_be_block(text: str) -> bool:
    """Whether an output that begins with `text` may still be, whole, a JSON block (fenced or bare)."""
    body = text.lstrip()
    if FENCE.startswith(body):
        return True  # nothing yet, or the fence's start
    if body.startswith(FENCE):
        end = body.find("```", len(FENCE))
        return end < 0 or not body[end + 3 :].strip()
    if not body.startswith(("{", "[")):
        return False
    try:
        _, end = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError:
        return True  # not complete yet (or never: the end tells)
    return not body[end:].strip()


def _held(text: str) -> int:
    """Characters at the end of `text` to hold back: trailing whitespace, and a tail that begins `<tool_call>`."""
    tail = marker_start(text, (OPEN,))
    rest = text[: len(text) - tail]
    return tail + len(rest) - len(rest.rstrip())


def _hermes_call(body: str) -> OutToolCall | None:
    """`{"name": ..., "arguments": {...}}` as a call; None where it is not one."""
    try:
        return _call_of(json.loads(body))
    except json.JSONDecodeError:
        return None


def _call_of(obj: Any) -> OutToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return OutToolCall(id=new_call_id(), function=OutFunctionCall(name=obj["name"], arguments=text))


def delta_calls(calls: list[OutToolCall], first: int) -> list[DeltaToolCall]:
    """Calls as a stream delta's `tool_calls`, indexed from `first` (the calls the choice sent before)."""
    return [
        DeltaToolCall(
            index=first + k,
            id=c.id,
            type="function",
            function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments),
        )
        for k, c in enumerate(calls)
    ]
