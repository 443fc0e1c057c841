"""vLLM's `/tokenize` and `/detokenize`: text or a conversation to the token ids this server runs, and back.

    POST /tokenize    {"model"?, "prompt", "add_special_tokens"?} or
                      {"model"?, "messages", "add_generation_prompt"?, "chat_template_kwargs"?}
                      -> {"count", "max_model_len", "tokens"} (and "token_strs" with `return_token_strs`)
    POST /detokenize  {"model"?, "tokens"} -> {"prompt"}

The ids are those a completions or chat request runs on: text tokenized as a completions prompt is
(control-token text as plain text), messages through the same chat template as a chat request.
`model` may be left out, as in vLLM; given, it must be the served one. Detokenizing keeps special
tokens, as vLLM's does. Unknown fields are ignored or refused as on the other routes.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, Field, ValidationError

from deploy.front.frontdoor import FrontDoor, RequestError, from_validation_error
from deploy.openai.api import IF_NONE, REQUEST_MODEL, RESPONSE_MODEL, ChatMessage, TokenId
from deploy.openai.prompts import Turn, chat_prompt_ids, chat_template_kwargs
from deploy.openai.unknown_fields import ignored_fields

M = TypeVar("M", "TokenizeRequest", "DetokenizeRequest")


class TokenizeRequest(BaseModel):
    """POST /tokenize: `prompt` (text) or `messages` (a conversation), as vLLM's two request shapes."""

    model_config = REQUEST_MODEL

    model: str | None = Field(default=None, description="The served model's name; may be left out.")
    prompt: str | None = Field(default=None, description="Text, tokenized as a /v1/completions prompt.")
    messages: list[ChatMessage] | None = Field(
        default=None, min_length=1, max_length=4096, description="A conversation, rendered as /v1/chat/completions."
    )
    add_special_tokens: bool | None = Field(
        default=None, description="With prompt: add BOS etc. as the tokenizer does (default true)."
    )
    add_generation_prompt: bool | None = Field(
        default=None, description="With messages: open the assistant's turn (default true)."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description="With messages: template variables.")
    return_token_strs: bool | None = Field(default=None, description="Add each token's string (`token_strs`).")


class TokenizeResponse(BaseModel):
    model_config = RESPONSE_MODEL

    count: int
    max_model_len: int = Field(description="The context window the deployment serves, as /v1/models says.")
    tokens: list[int]
    token_strs: list[str] | None = Field(default=None, **IF_NONE)


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = REQUEST_MODEL

    model: str | None = Field(default=None, description="The served model's name; may be left out.")
    tokens: list[TokenId] = Field(description="Token ids of the served model's tokenizer.")


class DetokenizeResponse(BaseModel):
    model_config = RESPONSE_MODEL

    prompt: str


def tokenize(front: FrontDoor, body: bytes, max_model_len: int) -> tuple[TokenizeResponse, list[str]]:
    """The reply to a /tokenize body, and the names of the fields it ignores. Tokenizes: run it off the loop."""
    request, ignored = _parse(front, TokenizeRequest, body)
    if request.messages is not None:
        if request.prompt is not None:
            raise RequestError("prompt: send `prompt` or `messages`, not both", param="prompt")
        if request.add_special_tokens:
            why = "only false with messages: the chat template places the special tokens"
            raise RequestError(f"add_special_tokens: {why}", param="add_special_tokens")
        template = chat_template_kwargs(request.chat_template_kwargs, front.tokenizer)
        turn = Turn(add_generation_prompt=request.add_generation_prompt is not False)
        ids = chat_prompt_ids(request.messages, front.tokenizer, front.prompts, turn, template)
    elif request.prompt is not None:
        for name in ("add_generation_prompt", "chat_template_kwargs"):
            if getattr(request, name) is not None:
                raise RequestError(f"{name}: only with messages", param=name)
        ids = front.prompts.text(request.prompt, add_special_tokens=request.add_special_tokens is not False)
    else:
        raise RequestError("prompt: send `prompt` (text) or `messages` (a conversation)", param="prompt")
    strs = [str(t) for t in front.tokenizer.convert_ids_to_tokens(ids)] if request.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs), ignored


def detokenize(front: FrontDoor, body: bytes) -> tuple[DetokenizeResponse, list[str]]:
    """The reply to a /detokenize body, and the names of the fields it ignores."""
    request, ignored = _parse(front, DetokenizeRequest, body)
    vocab = len(front.tokenizer)
    if (bad := next((i for i, t in enumerate(request.tokens) if t >= vocab), None)) is not None:
        param = f"tokens.[{bad}]"
        raise RequestError(f"{param}: {request.tokens[bad]} is not a token id of this model (0..{vocab - 1})", param)
    return DetokenizeResponse(prompt=front.decode(list(request.tokens), skip_special_tokens=False)), ignored


def _parse(front: FrontDoor, cls: type[M], body: bytes) -> tuple[M, list[str]]:
    """A validated body and the undeclared fields it has (refused as the deployment says); checks `model`."""
    try:
        request = cls.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e) from None
    ignored = ignored_fields(request, front.config.unknown_fields)
    if request.model is not None:
        front.check_model(request.model)
    return request, ignored
