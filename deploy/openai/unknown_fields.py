"""Request fields the OpenAI HTTP API does not declare: ignored or refused, as `front_door.unknown_fields` says.

The request models keep the fields they do not declare aside (pydantic's extra="allow": `model_extra`,
on nested models too: messages, their content parts, stream_options). `reject` refuses the first,
as OpenAI does ("Unrecognized request argument supplied"). `ignore`, as vLLM does, serves the
request without them; the front door logs their names at warning level and sends them back in the
`x-specserve-ignored-fields` header. Under `ignore`, a vLLM extension this server does not
implement, set to a value that would change the output (a grammar, beam search, a prompt cut), is
still refused with the reason: ignoring it would answer something other than what was asked.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel

from deploy.front.frontdoor import RequestError, param_path

logger = logging.getLogger(__name__)

IGNORED_HEADER = "x-specserve-ignored-fields"
_HEADER_CHARS = 1024  # a request may hold thousands of unknown fields: the header names the first ones

_NOT_SUPPORTED = "not supported by this server"
_GRAMMAR = "not supported: structured output is response_format, guided_json / regex / choice / grammar"
_TEMPLATE = "not supported: the model's own chat template renders every conversation"
# vLLM's (and OpenAI's older) request fields this server does not implement: the values that ask
# nothing of it beyond null (empty lists and maps included), and why another value is refused.
_NOT_HONOURED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "beam search is not supported by this server"),
    "length_penalty": ((1,), "applies to beam search, which this server does not support"),
    "prompt_logprobs": ((), _NOT_SUPPORTED),
    "truncate_prompt_tokens": ((), "not supported: send a prompt that fits the context window"),
    "allowed_token_ids": ((), _NOT_SUPPORTED),
    "bad_words": ((), _NOT_SUPPORTED),
    "logits_processors": ((), _NOT_SUPPORTED),
    "prompt_embeds": ((), "not supported: send text or token ids"),
    "structural_tag": ((), _GRAMMAR),
    "functions": ((), "deprecated by OpenAI: send tools"),
    "function_call": (("none",), "deprecated by OpenAI: send tool_choice with tools"),
    "audio": ((), "audio output is not supported by this server"),
    "modalities": ((["text"],), "only text output is supported"),
}
_CHAT_NOT_HONOURED: dict[str, tuple[tuple[Any, ...], str]] = {
    "echo": ((False,), "not supported for chat (vLLM's repeat of the last message)"),
    "add_special_tokens": ((False,), "only false: the chat template places the special tokens"),
    "chat_template": ((), _TEMPLATE),
    "documents": ((), _TEMPLATE),
    "mm_processor_kwargs": ((), "only text is supported"),
}
_COMPLETIONS_NOT_HONOURED: dict[str, tuple[tuple[Any, ...], str]] = {
    "add_special_tokens": ((True,), "only true: text is tokenized as the model's tokenizer does by default"),
}


def not_honoured(chat: bool) -> dict[str, tuple[tuple[Any, ...], str]]:
    """The undeclared fields a completions (or chat) request may hold only at their neutral values."""
    return _NOT_HONOURED | (_CHAT_NOT_HONOURED if chat else _COMPLETIONS_NOT_HONOURED)


def undeclared(model: BaseModel, prefix: tuple[int | str, ...] = ()) -> Iterator[tuple[tuple[int | str, ...], Any]]:
    """(location, value) of each field `model`, and the request models within it, hold without declaring."""
    for name, value in (model.model_extra or {}).items():
        yield prefix + (name,), value
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            yield from undeclared(value, prefix + (name,))
        elif isinstance(value, list | tuple) and value and isinstance(value[0], BaseModel):  # lists of one type
            for i, item in enumerate(value):
                yield from undeclared(item, prefix + (name, i))


def ignored_fields(
    request: BaseModel,
    mode: Literal["ignore", "reject"],
    refused: dict[str, tuple[tuple[Any, ...], str]] | None = None,
) -> list[str]:
    """The names (as errors name fields) of the undeclared fields to ignore; RequestError for the first that
    `mode` refuses, or (top-level, under `ignore`) that `refused` holds at a value other than its neutral ones."""
    found = list(undeclared(request))
    for loc, value in found:
        param = param_path(loc) or ""
        if mode == "reject":
            raise RequestError(f"Unrecognized request argument supplied: {param}", param=param)
        neutral, why = (refused or {}).get(str(loc[0]), (None, "")) if len(loc) == 1 else (None, "")
        if neutral is not None and not (value is None or value == [] or value == {} or value in neutral):
            raise RequestError(f"{param}: {why}", param=param)
    return [param_path(loc) or "" for loc, _ in found]


def ignored_header(names: list[str]) -> dict[str, str]:
    """The response header naming the fields a request had ignored (none if none), which are logged here."""
    if not names:
        return {}
    value = ", ".join(_printable(n) for n in names)
    value = value if len(value) <= _HEADER_CHARS else value[: _HEADER_CHARS - 3] + "..."
    logger.warning("request fields ignored (front_door.unknown_fields: ignore): %s", value)
    return {IGNORED_HEADER: value}


def _printable(name: str) -> str:
    """A field name as header text: printable ASCII, anything else escaped (a name may hold a newline)."""
    return "".join(c if " " <= c <= "~" and c != "\\" else f"\\u{ord(c):04x}" for c in name)
