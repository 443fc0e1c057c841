"""OpenAI's `/v1/completions` and `/v1/chat/completions`: requests, responses, errors, and the mapping.

Requests are validated as OpenAI validates them: strict JSON types (`"temperature": "1"` is an
error), values in OpenAI's ranges. Fields the models do not declare are kept aside (`model_extra`)
and ignored or refused as the deployment says (`front_door.unknown_fields`, deploy/openai/unknown_fields.py).
Fields OpenAI defines that this server cannot honour (tools) are accepted at their neutral value
and refused otherwise, naming the field. Structured output (`response_format`, vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `structured_outputs`) is deploy/openai/structured_output.py's.
`logprobs` / `top_logprobs` are the target's raw log probabilities (before temperature and
penalties, vLLM's default). Extensions, as vLLM spells them: `top_k`, `min_p`, `min_tokens`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, `return_token_ids`,
`include_stop_str_in_output`, `skip_special_tokens`, `chat_template_kwargs`; and specserve's own
`max_draft_tokens` (0 turns speculation off for the request: same tokens, plain decoding; for A/B
runs on one deployment, or latency-critical requests).

`openai_to_generation` maps a validated request's prompt (one of a completions batch) to what the
router takes: prompt token ids and a `SamplingParams` dict; deploy/openai/choices.py makes the
request's choices of them (`n`, batches, `echo`). Responses follow OpenAI's format; `usage` adds
the speculative decoding counts (`draft_tokens`, `accepted_tokens`, `acceptance_length`).
"""

from __future__ import annotations

import difflib
import time
import uuid
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler, WrapValidator

from actors.admission import ContextWindow
from deploy.front.frontdoor import (
    MAX_STOP,
    MAX_STOP_TOKEN_IDS,
    FrontDoor,
    RequestError,
    check_stops,
    fit_context,
    from_validation_error,
    sampling_params,
)
from deploy.openai.prompts import (
    Turn,
    chat_prompt_ids,
    chat_template_kwargs,
    completion_prompt_ids,
    completion_prompt_param,
)
from deploy.openai.structured_output import ResponseFormat, StructuredOutputs, request_grammar
from deploy.openai.tools import (
    DeltaToolCall,
    OutToolCall,
    Tool,
    ToolCall,
    ToolChoice,
    ToolUse,
    parser_for,
    template_turn_calls,
    tool_use,
)

# extra="allow": unknown fields land in `model_extra`, for deploy/openai/unknown_fields.py to ignore or refuse
REQUEST_MODEL = ConfigDict(extra="allow", strict=True, allow_inf_nan=False, frozen=True)
RESPONSE_MODEL = ConfigDict(extra="forbid")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the context's end
# Each choice is a sequence of its own in the router: a request's choices are bounded as its size is.
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 32  # prompts in one /v1/completions request
MAX_CHOICES = 64  # choices per request: prompts x n
MAX_LOGPROBS = 20  # top log probabilities per token (vLLM's default max_logprobs)
MAX_LOGIT_BIAS = 1024  # logit_bias entries (SamplingParams' bound)


def _one_of(expected: str) -> WrapValidator:
    """A union field's error as one message ("must be a string or a list of strings"), not one per member."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(f"must be {expected}") from None

    return WrapValidator(check)


TokenId = Annotated[int, Field(ge=0, lt=2**31)]
Prompt = Annotated[
    str | list[TokenId] | list[str] | list[list[TokenId]],
    _one_of("a string, a list of strings, a list of token ids or a list of token-id lists"),
]
Stop = Annotated[
    str | list[str] | None, _one_of(f"a string or a list of at most {MAX_STOP} strings"), Field(default=None)
]


class StreamOptions(BaseModel):
    model_config = REQUEST_MODEL

    include_usage: bool = Field(default=False, description="Send a last chunk with usage and no choices.")


class _SamplingFields(BaseModel):
    """The fields both endpoints share."""

    model_config = REQUEST_MODEL

    model: str = Field(description="The served model's name (GET /v1/models).")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description="0 is greedy; default 1.")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description="Nucleus mass kept; default 1.")
    n: int | None = Field(
        default=None, ge=1, le=MAX_N, description="Choices per prompt, each sampled with a seed of its own."
    )
    stream: bool | None = Field(default=None, description="Server-sent events in OpenAI's chunk format.")
    stream_options: StreamOptions | None = Field(default=None, description="Only with stream: true.")
    stop: Stop
    seed: int | None = Field(default=None, ge=0, lt=2**63, description="Reproducible sampling; default random.")
    frequency_penalty: float | None = Field(
        default=None, ge=-2.0, le=2.0, description="Subtracted from a token's logit per occurrence in the output."
    )
    presence_penalty: float | None = Field(
        default=None, ge=-2.0, le=2.0, description="Subtracted from the logit of every token in the output."
    )
    logit_bias: dict[str, float] | None = Field(
        default=None, description="Token id (as a string) -> bias in -100..100, added to its logit."
    )
    user: str | None = Field(default=None, max_length=512, description="End-user id; accepted, unused.")
    # extensions (vLLM's names)
    top_k: int | None = Field(default=None, ge=-1, le=1_000_000, description="Keep the k most likely; -1/0: all.")
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=10.0, description="HF/CTRL penalty; 1: off.")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, description="Drop tokens below min_p x the top one.")
    min_tokens: int | None = Field(default=None, ge=0, le=1_000_000, description="No end or stop token before this.")
    ignore_eos: bool | None = Field(default=None, description="Generate past end-of-sequence tokens.")
    stop_token_ids: list[TokenId] | None = Field(  # bounded by check_stops, as on gRPC (the same message)
        default=None, json_schema_extra={"maxItems": MAX_STOP_TOKEN_IDS}, description="Extra stop tokens."
    )
    return_token_ids: bool | None = Field(default=None, description="Add `token_ids` to each choice.")
    include_stop_str_in_output: bool | None = Field(
        default=None, description="Keep the stop string (or stop token) the output ended on in the text."
    )
    skip_special_tokens: bool | None = Field(
        default=None, description="Leave special tokens out of the text (default true); the token ids keep them."
    )
    # structured output (deploy/openai/structured_output.py): OpenAI's response_format, vLLM's guided fields
    response_format: ResponseFormat | None = Field(
        default=None, description="{'type': 'json_object'} or {'type': 'json_schema', 'json_schema': {...}}."
    )
    guided_json: dict[str, Any] | str | None = Field(default=None, description="A JSON schema the output follows.")
    guided_regex: str | None = Field(default=None, description="A regular expression the output matches.")
    guided_choice: list[str] | None = Field(default=None, description="The output is one of these strings.")
    guided_grammar: str | None = Field(
        default=None, max_length=1_000_000, description="A grammar the output follows: GBNF (`root ::= ...`) or Lark."
    )
    structured_outputs: StructuredOutputs | None = Field(
        default=None, description="vLLM's: one of json, regex, choice, json_object."
    )
    # specserve's own
    max_draft_tokens: int | None = Field(
        default=None, ge=0, le=64, description="Most draft tokens per step; 0: no speculation for this request."
    )

    def _limits(self) -> list[tuple[str, bool, str]]:
        """(field, honoured, why not) for fields OpenAI defines that this server honours only in part."""
        return [
            ("stream_options", self.stream_options is None or bool(self.stream), "only allowed when stream is true"),
        ]

    def unsupported(self) -> RequestError | None:
        """The first field set to a value this server cannot honour."""
        bad = next(((name, why) for name, ok, why in self._limits() if not ok), None)
        return None if bad is None else RequestError(f"{bad[0]}: {bad[1]}", param=bad[0])


R = TypeVar("R", bound=_SamplingFields)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: Prompt = Field(description=f"Text or token ids, or a batch of up to {MAX_PROMPTS} of either.")
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000, description="Default 16.")
    echo: bool | None = Field(default=None, description="Put the prompt's text before each choice's text.")
    logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="Each token's log probability and this many top ones."
    )
    best_of: int | None = Field(default=None, ge=1, le=20, description="Only best_of = n is supported.")
    suffix: str | None = Field(
        default=None,
        description="Text after the completion: a fill-in-the-middle prompt, for models whose tokenizer has "
        "FIM tokens (<|fim_prefix|>... as Qwen2.5-Coder, <fim_prefix>... as StarCoder); 400 otherwise.",
    )

    def _limits(self) -> list[tuple[str, bool, str]]:
        best_of = "only best_of = n is supported: ranking more candidates needs their log probabilities"
        return super()._limits() + [
            ("best_of", self.best_of in (None, self.n or 1), best_of),
        ]


class TextPart(BaseModel):
    model_config = REQUEST_MODEL

    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str


Content = Annotated[str | list[TextPart], _one_of("a string or a list of text parts ({'type': 'text', 'text': ...})")]


def content_text(content: str | list[TextPart]) -> str:
    """A message's (or a prediction's) content as one text: its parts joined by newlines."""
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: text the output is expected to repeat (a file being edited)."""

    model_config = REQUEST_MODEL

    type: Literal["content"] = Field(description="Only predicted content.")
    content: Content


class ChatMessage(BaseModel):
    model_config = REQUEST_MODEL

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = Field(default=None, description="Required but for an assistant's tool calls.")
    name: str | None = Field(default=None, max_length=256, description="Accepted, not shown to the model.")
    tool_calls: list[ToolCall] | None = Field(
        default=None, max_length=128, description="An assistant's calls (deploy/openai/tools.py)."
    )
    tool_call_id: str | None = Field(default=None, max_length=256, description="A tool's result: the call it answers.")

    def text(self) -> str:
        return "" if self.content is None else content_text(self.content)

    def template_turn(self, param: str) -> dict[str, Any]:
        # The template knows the roles its model was trained with; OpenAI's `developer` is the system role.
        turn: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            turn["tool_calls"] = template_turn_calls(self.tool_calls, param)
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        return turn

    def problem(self) -> tuple[str, str] | None:
        """(field, what is wrong) where the message's fields do not fit its role."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            return "content", "required (only an assistant message with tool_calls may leave it out)"
        if self.tool_calls and self.role != "assistant":
            return "tool_calls", "only an assistant message makes tool calls"
        if self.role == "tool" and self.tool_call_id is None:
            return "tool_call_id", "required in a tool message: the id of the call it answers"
        return None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=4096, description="The conversation so far.")
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000, description="Deprecated by OpenAI.")
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1_000_000, description="Default: the rest.")
    logprobs: bool | None = Field(default=None, description="Each output token's log probability.")
    top_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="With logprobs: this many most likely tokens at each."
    )
    tools: list[Tool] | None = Field(default=None, max_length=128, description="Functions the model may call.")
    tool_choice: ToolChoice | None = Field(
        default=None, description="none, auto (the default with tools), required, or {'type': 'function', ...}."
    )
    parallel_tool_calls: bool | None = Field(default=None, description="False: at most one call (default true).")
    prediction: Prediction | None = Field(
        default=None,
        description="Predicted Outputs: prompt lookup drafts from this text too, so the parts of the output that "
        "repeat it come sooner (greedy requests); the output is the same without it.",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="Variables for the chat template (e.g. enable_thinking)."
    )
    add_generation_prompt: bool = Field(default=True, description="Open the assistant's turn after the messages.")
    continue_final_message: bool = Field(
        default=False,
        description="The output continues the last message, an assistant's (a prefill), instead of a new turn; "
        "with add_generation_prompt false.",
    )

    def _limits(self) -> list[tuple[str, bool, str]]:
        last = self.messages[-1].role if self.messages else None
        return (
            super()._limits()
            + [
                (
                    "top_logprobs",
                    self.top_logprobs is None or bool(self.logprobs),
                    "only allowed when logprobs is true",
                ),
            ]
            + [
                (f"messages.[{i}].{problem[0]}", False, problem[1])
                for i, m in enumerate(self.messages)
                if (problem := m.problem()) is not None
            ]
            + [
                (
                    "continue_final_message",
                    not (self.continue_final_message and self.add_generation_prompt),
                    "cannot be true with add_generation_prompt true: send add_generation_prompt false",
                ),
                (
                    "continue_final_message",
                    not self.continue_final_message or last == "assistant",
                    "the last message must be the assistant's, the one the output continues",
                ),
            ]
        )


def parse_request(cls: type[R], body: bytes) -> R:
    """Validate a raw JSON body; every problem becomes a RequestError naming its field."""
    try:
        request = cls.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e) from None
    if (error := request.unsupported()) is not None:
        raise error
    return request


# ---- request -> router --------------------------------------------------------------------------
def logit_bias_pairs(bias: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's {"token id": bias} as SamplingParams' (id, bias) pairs; RequestError naming a bad entry."""
    if not bias:
        return None
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias: {len(bias)} entries; at most {MAX_LOGIT_BIAS}", param="logit_bias")
    pairs = []
    for key, value in bias.items():
        if not key.isdigit() or int(key) >= vocab:
            raise RequestError(f"logit_bias: {key!r} is not a token id in 0..{vocab - 1}", param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise RequestError(f"logit_bias: the bias of {key} is {value}, not within -100..100", param="logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def asked_logprobs(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    """SamplingParams.logprobs: top alternatives per token, None for no log probabilities."""
    if isinstance(request, ChatCompletionRequest):
        return (request.top_logprobs or 0) if request.logprobs else None
    return request.logprobs


def openai_to_generation(
    request: CompletionRequest | ChatCompletionRequest,
    front: FrontDoor,
    seed: int,
    window: ContextWindow | None = None,
    prompt_index: int = 0,
    tools: ToolUse | None = None,
) -> tuple[list[int], dict[str, Any]]:
    """Prompt token ids and the SamplingParams dict of a validated request (of its prompt `prompt_index`,
    for a completions batch). `tools`: a chat request's `request_tools` where the caller has them (else made here).

    `window`: what the deployment serves (`FrontDoor.served_window`); None: the front door's own.

    `seed` is used when the request has none (the caller draws a fresh one, so unseeded sampled
    requests differ). Raises RequestError naming the field. Tokenizes: run it off the event loop.
    """
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    check_stops(stop, request.stop_token_ids or ())  # before tokenizing: cheap refusals first
    if isinstance(request, ChatCompletionRequest):
        template = chat_template_kwargs(request.chat_template_kwargs, front.tokenizer)
        turn = Turn(request.add_generation_prompt, request.continue_final_message)
        tools = tools or request_tools(request, front)
        listed = tools.tools if tools is not None else None
        prompt = chat_prompt_ids(request.messages, front.tokenizer, front.prompts, turn, template, listed)
        prompt_param = "messages"
        max_param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        asked, default = request.max_completion_tokens or request.max_tokens, None
    else:
        tools = None
        prompt_param = completion_prompt_param(request.prompt, prompt_index)
        prompt = completion_prompt_ids(request.prompt, front.prompts, prompt_index, request.suffix)
        max_param, asked, default = "max_tokens", request.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS
    window = window or front.served_window({})
    prediction = predicted_ids(request, front)
    if prediction is not None and len(prediction) > window.tokens:
        message = f"prediction: {len(prediction)} tokens, more than the context window's {window.tokens}"
        raise RequestError(message, param="prediction")
    max_tokens = fit_context(len(prompt), asked, default, window, prompt_param, max_param)
    fields = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": max(request.top_k, 0) if request.top_k is not None else None,
        "repetition_penalty": request.repetition_penalty,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "logit_bias": logit_bias_pairs(request.logit_bias, len(front.tokenizer)),
        "min_p": request.min_p,
        "min_tokens": request.min_tokens,
        "logprobs": asked_logprobs(request),
        "max_tokens": max_tokens,
        "stop": tuple(stop),
        "stop_token_ids": tuple(request.stop_token_ids or ()),
        "ignore_eos": request.ignore_eos,
        "max_draft_tokens": request.max_draft_tokens,
        "seed": request.seed if request.seed is not None else seed,
        "prediction": prediction,
        "grammar": request_grammar(request, front.grammars.unavailable, tools.grammar if tools else None)[0],
    }
    return prompt, sampling_params(fields)


def predicted_ids(request: CompletionRequest | ChatCompletionRequest, front: FrontDoor) -> tuple[int, ...] | None:
    """A chat request's `prediction` as token ids (tokenized as message text is: control-token text stays text)."""
    prediction = getattr(request, "prediction", None)
    if prediction is None:
        return None
    return tuple(front.prompts.text(content_text(prediction.content), add_special_tokens=False))


def request_tools(request: ChatCompletionRequest, front: FrontDoor) -> ToolUse | None:
    """What the request's `tools`, `tool_choice` and `parallel_tool_calls` ask of this model (None: no tools)."""
    parser = parser_for(front.config.tool_call_parser, front.tokenizer.chat_template)
    return tool_use(request.tools, request.tool_choice, request.parallel_tool_calls, parser)


# ---- responses -----------------------------------------------------------------------------------
FinishReason = Literal["stop", "length", "tool_calls"] | None
IF_NONE: dict[str, Any] = {"exclude_if": lambda v: v is None}


class CompletionTokensDetails(BaseModel):
    """OpenAI's Predicted Outputs counts: of the prediction's tokens, those the output repeats and the rest."""

    model_config = RESPONSE_MODEL

    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class Usage(BaseModel):
    model_config = RESPONSE_MODEL

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = Field(default=None, **IF_NONE)
    draft_tokens: int = Field(description="Draft tokens proposed to the target for this request.")
    accepted_tokens: int = Field(description="Draft tokens the target accepted.")
    acceptance_length: float = Field(description="Tokens committed per target forward, bonus included.")

    @classmethod
    def from_router(cls, usage: dict[str, Any]) -> Usage:
        """From the router's usage dict, with `predicted` (the front door's `prediction_usage`) where asked."""
        prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
        predicted = usage.get("predicted")
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            completion_tokens_details=None if predicted is None else CompletionTokensDetails(**predicted),
            draft_tokens=int(usage.get("drafted", 0)),
            accepted_tokens=int(usage.get("accepted", 0)),
            acceptance_length=float(usage.get("acceptance_length", 0.0)),
        )


def prediction_usage(usage: dict[str, Any], sampling: dict[str, Any], output: list[int]) -> dict[str, Any]:
    """The router's usage of a choice with `predicted`, OpenAI's counts, where its request had a prediction:
    the prediction's tokens that the output repeats, in order (difflib's matching blocks: a longest common
    subsequence's worth), and those it does not. CPU in the lengths' product at worst: run it off the loop."""
    prediction = sampling.get("prediction") or ()
    if not prediction:
        return usage
    matcher = difflib.SequenceMatcher(None, list(prediction), output, autojunk=False)
    accepted = sum(block.size for block in matcher.get_matching_blocks())
    counts = {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": len(prediction) - accepted}
    return usage | {"predicted": counts}


class SpecDecodeMetrics(BaseModel):
    """vLLM's per-request speculative decoding summary (`--per-request-spec-decode-metrics summary`)."""

    model_config = RESPONSE_MODEL

    mean_acceptance_length: float = Field(description="1 + accepted draft tokens per step that drafted.")
    draft_acceptance_rate: float = Field(description="Accepted draft tokens over those proposed.")
    acceptance_histogram: list[int] = Field(description="[j]: steps that drafted and kept exactly j draft tokens.")
    num_spec_steps: int = Field(description="Target steps (verify forwards) with a draft.")
    num_accepted_draft_tokens: int
    num_draft_tokens: int
    num_spec_tokens: int = Field(description="The most draft tokens (tree nodes) one step proposed.")

    @classmethod
    def of(cls, usages: list[dict[str, Any]]) -> SpecDecodeMetrics:
        """Over a request's choices (the router's usage dicts)."""
        steps, accepted, drafted = (sum(int(u.get(k, 0)) for u in usages) for k in ("drafts", "accepted", "drafted"))
        histogram = [0] * max((len(u.get("acceptance_histogram", ())) for u in usages), default=0)
        for u in usages:
            for j, count in enumerate(u.get("acceptance_histogram", ())):
                histogram[j] += int(count)
        return cls(
            mean_acceptance_length=1.0 + accepted / steps if steps else 0.0,
            draft_acceptance_rate=accepted / drafted if drafted else 0.0,
            acceptance_histogram=histogram,
            num_spec_steps=steps,
            num_accepted_draft_tokens=accepted,
            num_draft_tokens=drafted,
            num_spec_tokens=max((int(u.get("spec_tokens", 0)) for u in usages), default=0),
        )


class Metrics(BaseModel):
    """A response's `metrics` (vLLM's per-request metrics object)."""

    model_config = RESPONSE_MODEL

    speculative_decoding: SpecDecodeMetrics


class _Choice(BaseModel):
    """What every choice holds beside its text, message or delta."""

    model_config = RESPONSE_MODEL

    index: int = 0
    logprobs: dict[str, Any] | None = None
    finish_reason: FinishReason
    token_ids: list[int] | None = Field(default=None, **IF_NONE)


class CompletionChoice(_Choice):
    text: str


class _Response(BaseModel):
    """What every completion response and stream chunk starts with (OpenAI's `object` is each one's own)."""

    model_config = RESPONSE_MODEL

    id: str
    created: int
    model: str


class Completion(_Response):
    """A /v1/completions response, and (with `usage` only on the last) its stream chunks."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = Field(default=None, **IF_NONE)
    metrics: Metrics | None = Field(default=None, **IF_NONE)


class AssistantMessage(BaseModel):
    model_config = RESPONSE_MODEL

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = Field(default=None, **IF_NONE)  # a thinking model's (deploy/openai/reasoning.py)
    tool_calls: list[OutToolCall] | None = Field(default=None, **IF_NONE)


class ChatChoice(_Choice):
    message: AssistantMessage


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    metrics: Metrics | None = Field(default=None, **IF_NONE)


class Delta(BaseModel):
    model_config = RESPONSE_MODEL

    role: Literal["assistant"] | None = Field(default=None, **IF_NONE)
    content: str | None = Field(default=None, **IF_NONE)
    reasoning_content: str | None = Field(default=None, **IF_NONE)
    tool_calls: list[DeltaToolCall] | None = Field(default=None, **IF_NONE)


class ChunkChoice(_Choice):
    delta: Delta


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]
    usage: Usage | None = Field(default=None, **IF_NONE)
    metrics: Metrics | None = Field(default=None, **IF_NONE)


class ErrorInfo(BaseModel):
    model_config = RESPONSE_MODEL

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    model_config = RESPONSE_MODEL

    error: ErrorInfo

    @classmethod
    def of(cls, e: RequestError) -> ErrorBody:
        return cls(error=ErrorInfo(message=e.message, type=e.type, param=e.param, code=e.code))


class ModelCard(BaseModel):
    model_config = RESPONSE_MODEL

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"
    max_model_len: int = Field(
        description="The context window (vLLM's name for it): the model's, or less where a replica's KV budget "
        "cannot hold that much for one sequence."
    )


class ModelList(BaseModel):
    model_config = RESPONSE_MODEL

    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(kind: Literal["cmpl", "chatcmpl"]) -> tuple[str, int]:
    """A response id and its creation time (seconds), as OpenAI forms them."""
    return f"{kind}-{uuid.uuid4().hex}", int(time.time())
