"""The choices of an OpenAI request: the sequences it runs in the router, one per choice.

A completions request has `n` choices for each prompt of its batch, indexed as OpenAI indexes them
(prompt_index * n + i); a chat request has `n`. Each choice samples with a seed of its own: choice
i of a prompt takes the request's `seed` for i = 0 and a hash of (seed, i) for the others, so
`n: 1` gives what it always gave, a seeded `n: 4` gives the same four choices on every run, and
each prompt of a batch gives what it gives alone. Without a `seed` the front door draws one per
request, and every choice (of every prompt) is hashed apart from it, so they differ.

`plan_request` is a request's CPU work (parse, check, tokenize, template): run it off the event loop.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from actors.admission import ContextWindow
from deploy.front.frontdoor import FrontDoor, RequestError
from deploy.openai import reasoning
from deploy.openai.api import (
    MAX_CHOICES,
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    openai_to_generation,
    parse_request,
    request_tools,
)
from deploy.openai.prompts import completion_prompt_param, completion_prompts
from deploy.openai.tools import ToolUse
from deploy.openai.unknown_fields import ignored_fields, not_honoured

OpenAIRequest = CompletionRequest | ChatCompletionRequest


@dataclass(frozen=True)
class Choice:
    """One sequence of a request: its place in the response, its prompt and its SamplingParams dict."""

    index: int
    prompt_ids: list[int]
    sampling: dict[str, Any]
    prompt_index: int  # in a completions batch; 0 for chat
    prompt_param: str  # how errors about its prompt name it: "prompt", "prompt.[2]", "messages"
    echo: str = ""  # text before the output's: the prompt's, with `echo`


@dataclass(frozen=True)
class Plan:
    """A parsed request, its choices in index order, the names of the undeclared fields it ignores, and (chat) its
    tools."""

    request: OpenAIRequest
    choices: list[Choice]
    ignored: list[str]
    tools: ToolUse | None = None
    thinks: bool | None = None  # chat with a thinking model: whether the output starts inside its reasoning

    @property
    def chat(self) -> bool:
        return isinstance(self.request, ChatCompletionRequest)


def plan_request(
    front: FrontDoor,
    cls: type[OpenAIRequest],
    body: bytes,
    seed: int,
    window: ContextWindow,
    kv_budget: int | None = None,
) -> Plan:
    """Parse, check the model and the request's size, tokenize each prompt: its choices.

    `seed`: drawn by the caller for a request that has none. `kv_budget`: the KV tokens a target replica holds
    (the router's info), which a prompt's `n` choices, admitted together on its lane's replica, must fit in at
    once. Raises RequestError naming the field.
    """
    request = parse_request(cls, body)
    refused = not_honoured(chat=isinstance(request, ChatCompletionRequest))
    ignored = ignored_fields(request, front.config.unknown_fields, refused)
    front.check_model(request.model)
    n = request.n or 1
    prompts = 1 if isinstance(request, ChatCompletionRequest) else check_batch(request, n)
    tools = request_tools(request, front) if isinstance(request, ChatCompletionRequest) else None
    choices = []
    for k in range(prompts):
        ids, sampling = openai_to_generation(request, front, seed, window, k, tools)
        if isinstance(request, ChatCompletionRequest):
            param, echo = "messages", ""
        else:
            param, echo = completion_prompt_param(request.prompt, k), echo_text(request, front, k)
        check_fits_at_once(n, len(ids) + sampling["max_tokens"], kv_budget)
        for i in range(n):
            seeded = sampling | {"seed": choice_seed(request.seed, seed, k * n + i, i)}
            choices.append(Choice(k * n + i, ids, seeded, k, param, echo))
    if not isinstance(request, ChatCompletionRequest):
        return Plan(request, choices, ignored)
    thinks = None
    if reasoning.parser_for(front.config.reasoning_parser, front.tokenizer.chat_template) is not None:
        thinks = reasoning.opens_thinking(front.decode(choices[0].prompt_ids[-8:], skip_special_tokens=False))
    return Plan(request, choices, ignored, tools, thinks)


def check_fits_at_once(n: int, tokens: int, kv_budget: int | None) -> None:
    """RequestError (400) when `n` choices of `tokens` (prompt + max_tokens) each can never be held at once: a
    request whose choices do not fit together would get 429 on every retry."""
    if kv_budget is None or n < 2 or n * tokens <= kv_budget:
        return
    raise RequestError(
        f"n: {n} choices of {tokens} tokens each (prompt + max_tokens) need {n * tokens} KV tokens at once, more "
        f"than a target replica holds, {kv_budget} (target_pool.kv_budget_tokens): ask for fewer choices or a "
        "smaller max_tokens",
        param="n",
        code="context_length_exceeded",
    )


def check_batch(request: CompletionRequest, n: int) -> int:
    """The number of prompts; RequestError for a batch of more than MAX_PROMPTS or MAX_CHOICES choices."""
    prompts = len(completion_prompts(request.prompt))
    if prompts > MAX_PROMPTS:
        raise RequestError(f"prompt: {prompts} prompts in one request; at most {MAX_PROMPTS}", param="prompt")
    if prompts * n > MAX_CHOICES:
        raise RequestError(
            f"n: {n} choices for each of {prompts} prompts make {prompts * n}; at most {MAX_CHOICES} per request",
            param="n",
        )
    return prompts


def choice_seed(request_seed: int | None, drawn: int, index: int, i: int) -> int:
    """The seed of choice `index` (the `i`th of its prompt): see the module's docstring."""
    if request_seed is not None:
        return _mix(request_seed, i)
    return _mix(drawn, index)


def _mix(seed: int, i: int) -> int:
    if i == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # SamplingParams takes seeds below 2**63


def echo_text(request: CompletionRequest, front: FrontDoor, index: int) -> str:
    """With `echo`, prompt `index`'s text: as sent, or its token ids decoded as the output is (the prompt
    alone: without the fill-in-the-middle markers and `suffix` the model was given)."""
    if not request.echo:
        return ""
    prompt = completion_prompts(request.prompt)[index]
    if isinstance(prompt, str):
        return prompt
    return front.decode(list(prompt), skip_special_tokens=request.skip_special_tokens is not False)
