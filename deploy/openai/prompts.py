"""The prompt of an OpenAI request as token ids: a completions prompt (one of a batch) or a chat conversation.

Client text is text: control-token text in a prompt or a message is tokenized as the characters it
is (deploy/front/prompts.py); only the chat template's own markers are control tokens. /v1/completions,
/v1/chat/completions and /tokenize tokenize through these, so /tokenize shows the ids a request runs on.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from transformers import PreTrainedTokenizerBase

from deploy.front.frontdoor import RequestError
from deploy.front.prompts import ControlTextRefused, PromptTokenizer


class Message(Protocol):
    """What rendering reads of a chat message (`openai_api.ChatMessage`)."""

    def template_turn(self, param: str) -> dict[str, Any]:
        """The message as chat templates take it (`role`, `content` text, and an assistant's `tool_calls`, a
        tool result's `tool_call_id`); RequestError naming `param`'s fields where it has none."""
        ...


def completion_prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """The prompts of a completions request: one (text or token ids), or each of a batch."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [cast(str | list[int], prompt)]
    return cast(list[str | list[int]], list(prompt))


def completion_prompt_param(prompt: str | list[int] | list[str] | list[list[int]], index: int) -> str:
    """How errors name prompt `index`: `prompt`, or `prompt.[i]` within a batch of more than one."""
    return "prompt" if len(completion_prompts(prompt)) == 1 else f"prompt.[{index}]"


# Fill-in-the-middle markers, in the prefix-suffix-middle order the models were trained on: Qwen2.5-Coder
# (and the Qwen2.5 tokenizers), then StarCoder / SantaCoder / DeepSeek-style models without the bars.
FIM_MARKERS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
)


def fim_markers(tokenizer: PreTrainedTokenizerBase) -> tuple[int, int, int] | None:
    """The ids of the tokenizer's prefix, suffix and middle markers, or None when it has no complete set."""
    vocab = tokenizer.get_vocab()
    for names in FIM_MARKERS:
        if all(name in vocab for name in names):
            prefix, suffix, middle = (vocab[name] for name in names)
            return prefix, suffix, middle
    return None


def completion_prompt_ids(
    prompt: str | list[int] | list[str] | list[list[int]],
    prompts: PromptTokenizer,
    index: int = 0,
    suffix: str | None = None,
) -> list[int]:
    """Prompt `index`'s ids: text is tokenized as the model's tokenizer does by default (BOS if it adds one),
    control-token text in it as plain text (send token ids to place control tokens). With a `suffix`, the
    fill-in-the-middle prompt `<prefix> prompt <suffix> suffix <middle>`: the model writes what goes between."""
    one = completion_prompts(prompt)[index]
    # A fill-in-the-middle prompt starts with its prefix marker, so no BOS within it.
    ids = prompts.text(one, add_special_tokens=suffix is None) if isinstance(one, str) else list(one)
    if not ids and suffix is None:
        param = completion_prompt_param(prompt, index)
        raise RequestError(f"{param}: must not be empty", param=param)
    if suffix is None:
        return ids
    markers = fim_markers(prompts.tokenizer)
    if markers is None:
        names = " or ".join("/".join(m) for m in FIM_MARKERS)
        raise RequestError(f"suffix: this model's tokenizer has no fill-in-the-middle tokens ({names})", "suffix")
    before, after, middle = markers
    return [before, *ids, after, *prompts.text(suffix, add_special_tokens=False), middle]


def chat_template_kwargs(kwargs: dict[str, Any] | None, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """A request's template variables (`enable_thinking`, ...); refused, naming it: a name that is no
    template variable name, or that is an argument of the render itself or the template's `messages`."""
    own = (set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}) | {"messages"}
    for name in kwargs or {}:
        if not name.isidentifier():
            shown = repr(name) if len(name) <= 60 else repr(name[:57]) + "..."
            message = f"chat_template_kwargs: {shown} is not a template variable name"
            raise RequestError(message, param="chat_template_kwargs")
        if name in own:
            param = f"chat_template_kwargs.{name}"
            raise RequestError(f"{param}: an argument of the template render, not a template variable", param=param)
    return dict(kwargs or {})


def template_format(configured: str, chat_template: str | None, name: str, marker: str) -> str | None:
    """The output format a front door's parser setting picks (`tool_call_parser`, `reasoning_parser`): `none` is
    None; `auto` is `name` where the chat template writes `marker` (what its model was trained to write), else
    None; any other value is itself."""
    if configured == "auto":
        return name if chat_template is not None and marker in chat_template else None
    return None if configured == "none" else configured


@dataclass(frozen=True)
class Turn:
    """Where the rendered conversation ends: the assistant's turn opened after it (`add_generation_prompt`), or the
    last message left open for the output to continue (`continue_final_message`, an assistant prefill)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False


def chat_prompt_ids(
    messages: Sequence[Message],
    tokenizer: PreTrainedTokenizerBase,
    prompts: PromptTokenizer,
    turn: Turn = Turn(),
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The conversation through the tokenizer's own chat template, ending as `turn` says, with
    `template_kwargs` as the template's variables and `tools` (OpenAI's tool definitions) as its tools.

    Only the template's markers are control tokens: control-token text inside a message's content
    is tokenized as plain text (deploy/front/prompts.py). In a tool definition or a call's arguments, which
    templates write out as JSON, it is refused.
    """
    if tokenizer.chat_template is None:
        raise RequestError("messages: this model has no chat template; use /v1/completions", param="messages")
    turns = [m.template_turn(f"messages.[{i}]") for i, m in enumerate(messages)]
    for param, value in [("tools", tools)] + [
        (f"messages.[{i}].tool_calls", t.get("tool_calls")) for i, t in enumerate(turns)
    ]:
        if value and (control := prompts.control_in(json.dumps(value, ensure_ascii=False))) is not None:
            raise RequestError(f"{param}: holds the control token `{control}`", param=param)
    variables = (template_kwargs or {}) | ({"tools": tools} if tools else {})

    def render(conversation: list[dict[str, Any]]) -> str:
        try:
            return str(
                tokenizer.apply_chat_template(
                    conversation,
                    tokenize=False,
                    add_generation_prompt=turn.add_generation_prompt,
                    continue_final_message=turn.continue_final_message,
                    **variables,
                )
            )
        except Exception as e:  # jinja's TemplateError and raise_exception(): the template refuses this conversation
            raise RequestError(f"messages: the model's chat template refused them: {e}", param="messages") from None

    try:
        ids = prompts.chat(turns, render)  # the template places BOS itself
    except ControlTextRefused as e:
        param = f"messages.[{e.index}].content"
        raise RequestError(
            f"{param}: holds the control token `{e.control}`, and this model's chat template changes message "
            "text, so it cannot be kept as plain text",
            param=param,
        ) from None
    if not ids:
        raise RequestError("messages: the conversation renders to no tokens", param="messages")
    return ids
