"""What the HTTP and gRPC front doors share: their config, the tokenizer, request errors, detokenizing.

The front doors turn a client's request into what the router takes (prompt token ids and a
`speculative.rules.sampling.SamplingParams` dict) and the router's token chunks back into text. The
router never sees text: tokenizing, chat templates, stop-string cuts and authentication live here,
at the boundary, so a malformed request is refused before it reaches a lane.
"""

from __future__ import annotations

import asyncio
import functools
import os
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from transformers import PreTrainedTokenizerBase

from actors.admission import ContextWindow
from deploy.front.prompts import PromptTokenizer
from speculative.rules.grammar import GrammarCompiler
from speculative.rules.sampling import SamplingParams

T = TypeVar("T")

# The bounds both front doors put on a request's stop conditions: one definition, so HTTP and gRPC
# refuse the same requests with the same message (`check_stops`).
MAX_STOP = 16  # stop strings per request: SamplingParams' own limit (OpenAI's is 4)
MAX_STOP_CHARS = 256  # characters per stop string: each is matched against the output's tail on every chunk
MAX_STOP_TOKEN_IDS = 64  # extra stop token ids per request: far more than any model's end markers

# Outputs shorter than this are detokenized on the event loop (a decode of a few hundred tokens takes
# well under a millisecond); longer ones on the front door's threads, as every chunk decodes them whole.
_DECODE_ON_LOOP_TOKENS = 512


class Backend(Protocol):
    """The router's public methods (actors/router.py), which the front doors wrap."""

    async def generate(self, prompt_token_ids: list[int], sampling: dict[str, Any] | None = None) -> dict[str, Any]:
        """{"token_ids", "finish_reason", "usage"} of one request run to completion."""
        ...

    def generate_stream(
        self, prompt_token_ids: list[int], sampling: dict[str, Any] | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Chunks {"token_ids", "finish_reason"}; the last has a finish_reason and "usage"."""
        ...

    async def info(self) -> dict[str, Any]:
        """The target's vocab_size, eos_ids and model, and the `context_window` (tokens) the deployment can give
        one sequence with the `context_limit` that sets it (actors/router.py); it answers once the target pool does."""
        ...

    async def ready(self) -> None:
        """Returns once a target replica can serve now (all its shards answer); raises when none can."""
        ...


class FrontDoorConfig(BaseModel):
    """How the front doors present the served model to clients."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    served_model_name: str = Field(
        min_length=1, max_length=256, description="The `model` clients send and /v1/models lists."
    )
    api_key: SecretStr | None = Field(
        default=None,
        description="Bearer token required on /v1/*, /tokenize, /detokenize, /docs, /openapi.json and gRPC calls; "
        "None (and no api_key_env) leaves them open. Prefer api_key_env: a config value is seen by whoever reads "
        "the config (serve status, the dashboard).",
    )
    api_key_env: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="The environment variable the ingress replicas read the API key from at start (a Kubernetes "
        "Secret mapped to it, or `export` before `ray start`); a replica where it is unset or empty fails to start.",
    )
    open: bool = Field(
        default=False,
        description="Serve without an API key although other machines can reach the server (http_options.host "
        "other than loopback, or gRPC, which Serve binds on every interface): for a network of its own behind a "
        "gateway that authenticates. False: such a start is refused with the reason (deploy/front/exposure.py).",
    )
    context_window: int | None = Field(
        default=None,
        ge=2,
        le=10_000_000,
        description="Most prompt + generated tokens; None: the target's max_position_embeddings. The front doors "
        "serve the smaller of this and what the deployment can give one sequence (the replicas' KV budgets).",
    )
    retry_after_s: int = Field(
        default=1, ge=0, le=3600, description="Retry hint (seconds) sent with 429 / RESOURCE_EXHAUSTED."
    )
    health_timeout_s: float = Field(
        default=5.0, gt=0, le=600, description="GET /health and Health fail if the target pool is silent longer."
    )
    max_request_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=1024,
        le=1024 * 1024 * 1024,
        description="Largest HTTP body / serialized gRPC request (bytes); larger ones get 413 / RESOURCE_EXHAUSTED. "
        "8 MiB: a 4 MB prompt, or 4,096 chat messages of 1 KB, fits with room for JSON escapes; Serve's gRPC "
        "proxy takes up to 2 GiB (RAY_SERVE_GRPC_MAX_MESSAGE_SIZE), so gRPC is checked here too.",
    )
    tokenizer_threads: int = Field(
        default=2,
        ge=1,
        le=64,
        description="Threads that parse requests, render chat templates, tokenize and detokenize long outputs, so "
        "the event loop serving every stream and /health never waits on a large prompt.",
    )
    tool_call_parser: Literal["auto", "hermes", "none"] = Field(
        default="auto",
        description="How tool calls are read out of the model's output (deploy/openai/tools.py): `hermes`, "
        "`<tool_call>{json}</tool_call>` as Qwen2.5 writes them; `auto`, hermes where the chat template writes "
        "`<tool_call>`; `none`, requests with tools are refused.",
    )
    reasoning_parser: Literal["auto", "think", "none"] = Field(
        default="auto",
        description="How a thinking model's reasoning is kept apart from its answer (deploy/openai/reasoning.py): "
        "`think`, the text between `<think>` and `</think>` goes to `reasoning_content`; `auto`, think where the chat "
        "template writes `</think>` (Qwen3, DeepSeek-R1); `none`, all of it is `content`.",
    )
    unknown_fields: Literal["ignore", "reject"] = Field(
        default="ignore",
        description="What the OpenAI HTTP API does with a request field it does not know. `ignore` (the default, as "
        "vLLM does): the request is served, the fields are logged at warning level and named in the response's "
        "`x-specserve-ignored-fields` header; clients and SDKs written for OpenAI or vLLM send fields a server "
        "does not know (`store`, `metadata`, `service_tier`, newer SDK fields), and refusing them makes a drop-in "
        "server fail. vLLM extensions that would change the output if ignored (`structural_tag`, `use_beam_search`, "
        "`truncate_prompt_tokens`...) are refused all the same. `reject`: any unknown field is a 400 naming it, as "
        "OpenAI answers. Known fields are validated strictly either way (docs/openai.md).",
    )
    per_request_spec_decode_metrics: bool = Field(
        default=False,
        description="Each completion (and a stream's usage chunk) carries `metrics.speculative_decoding` with "
        "vLLM's per-request fields (`--per-request-spec-decode-metrics summary`): mean_acceptance_length, "
        "draft_acceptance_rate, acceptance_histogram, num_spec_steps, num_accepted_draft_tokens, num_draft_tokens, "
        "num_spec_tokens.",
    )

    @model_validator(mode="after")
    def _one_key_source(self) -> FrontDoorConfig:
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError(
                "front_door: api_key and api_key_env both set; keep one (api_key_env keeps it out of configs)"
            )
        return self


@dataclass(frozen=True)
class FrontDoor:
    """A front door's runtime state: its config, the target's tokenizer and context window.

    Tokenizing a large prompt takes seconds of CPU: `off_loop` runs it (and parsing, templating,
    long detokenizing) on the front door's own threads; the tokenizer's Rust core lets go of the
    GIL, so the event loop keeps serving streams and /health meanwhile.
    """

    config: FrontDoorConfig
    tokenizer: PreTrainedTokenizerBase
    context_window: int
    prompts: PromptTokenizer = field(init=False, repr=False, compare=False)
    # The target tokenizer's grammar compiler, loaded at the first structured-output request: a tokenizer it
    # cannot read makes such requests a 400 here, before any worker is asked to mask by it.
    grammars: GrammarCompiler = field(init=False, repr=False, compare=False)
    _threads: ThreadPoolExecutor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompts", PromptTokenizer(self.tokenizer))
        object.__setattr__(self, "grammars", GrammarCompiler.lazy(lambda: self.tokenizer))
        threads = ThreadPoolExecutor(self.config.tokenizer_threads, thread_name_prefix="frontdoor")
        object.__setattr__(self, "_threads", threads)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the front door's threads; the event loop serves other requests meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, functools.partial(fn, *args))

    async def detokenize(self, detok: Detokenizer, token_ids: list[int], finish_reason: str | None = None) -> str:
        """`detok.push`, off the event loop once the output is long enough for its decode to hold the loop."""
        if len(detok.token_ids) + len(token_ids) < _DECODE_ON_LOOP_TOKENS:
            return detok.push(token_ids, finish_reason)
        return await self.off_loop(detok.push, token_ids, finish_reason)

    @property
    def model_name(self) -> str:
        return self.config.served_model_name

    def served_window(self, info: dict[str, Any]) -> ContextWindow:
        """The window clients get (/v1/models, Health, every request's check): the smaller of this front door's
        and the one the backend's `info` says the deployment can give one sequence."""
        own = (
            "front_door.context_window" if self.config.context_window else "the target model's max_position_embeddings"
        )
        window = ContextWindow(self.context_window, own)
        if "context_window" in info:
            window = ContextWindow.smallest(window, ContextWindow(info["context_window"], info["context_limit"]))
        return window

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise RequestError(
                f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                param="model",
                status=404,
                code="model_not_found",
            )

    def authorized(self, token: str | None) -> bool:
        """True when no key is configured or `token` is the key (constant-time comparison)."""
        key = self.config.api_key
        if key is None:
            return True
        return token is not None and secrets.compare_digest(token.encode(), key.get_secret_value().encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


def load_front_door(config: FrontDoorConfig, model: str, resolve: Callable[[str], str] = str) -> FrontDoor:
    """The target model's tokenizer and context window (no weights), and the API key from `api_key_env`;
    `resolve` as in actors/loading.py."""
    from transformers import AutoConfig, AutoTokenizer

    if config.api_key_env is not None:
        key = os.environ.get(config.api_key_env, "")
        if not key:
            raise ValueError(
                f"front_door.api_key_env: {config.api_key_env} is unset or empty in this replica's environment"
            )
        config = config.model_copy(update={"api_key": SecretStr(key)})

    path = resolve(model)
    window = config.context_window or int(AutoConfig.from_pretrained(path).max_position_embeddings)
    return FrontDoor(config, AutoTokenizer.from_pretrained(path), window)


def too_large(size: int | None, limit: int) -> RequestError:
    """The refusal of a request over `max_request_bytes` (HTTP 413; gRPC RESOURCE_EXHAUSTED); `size`: its bytes,
    None where it was cut off unread past the limit."""
    said = f"{size} bytes" if size is not None else f"over {limit} bytes (cut off there)"
    return RequestError(
        f"The request is {said}; this server takes at most {limit} bytes (front_door.max_request_bytes).",
        status=413,
        code="request_too_large",
    )


def check_stops(stop: Sequence[str], stop_token_ids: Sequence[int], prefix: str = "") -> None:
    """The bounds of MAX_STOP, MAX_STOP_CHARS and MAX_STOP_TOKEN_IDS; RequestError names the field (after `prefix`)."""
    problem = None
    if len(stop) > MAX_STOP:
        problem = "stop", f"at most {MAX_STOP} stop strings (got {len(stop)})"
    elif any(not s for s in stop):
        problem = "stop", "stop strings must be non-empty"
    elif any(len(s) > MAX_STOP_CHARS for s in stop):
        longest = max(len(s) for s in stop)
        problem = "stop", f"a stop string has at most {MAX_STOP_CHARS} characters (got {longest})"
    elif len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        problem = "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids (got {len(stop_token_ids)})"
    if problem is not None:
        param = prefix + problem[0]
        raise RequestError(f"{param}: {problem[1]}", param=param)


class RequestError(Exception):
    """A request the server refuses: an HTTP status, an OpenAI error type/code, the field at fault."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = message, param, status, code, type


def param_path(loc: tuple[int | str, ...]) -> str | None:
    """A pydantic error location as OpenAI names a parameter: ("messages", 0, "role") -> "messages.[0].role"."""
    return ".".join(f"[{part}]" if isinstance(part, int) else part for part in loc) or None


def from_validation_error(error: ValidationError, prefix: tuple[int | str, ...] = ()) -> RequestError:
    """The first problem of a pydantic error as a RequestError naming its field; unknown fields first."""
    details = error.errors(include_url=False)
    first = next((d for d in details if d["type"] == "extra_forbidden"), details[0])
    loc = prefix + tuple(first["loc"])
    message = str(first["msg"]).removeprefix("Value error, ")
    field, sep, rest = message.partition(": ")
    if first["type"] == "value_error" and not first["loc"] and sep and field.isidentifier():
        loc, message = loc + (field,), rest  # a model validator's "field: problem" (SamplingParams' stops)
    param = param_path(loc)
    if first["type"] == "json_invalid":
        return RequestError(f"We could not parse the JSON body of your request: {first['msg']}", code="invalid_json")
    if first["type"] == "extra_forbidden":
        return RequestError(f"Unrecognized request argument supplied: {param}", param=param)
    message = message[:1].lower() + message[1:]
    if first["type"] not in ("missing", "value_error") and "input" in first:
        message += f" (got {_short(first['input'])})"
    return RequestError(f"{param}: {message}" if param else message, param=param)


def sampling_params(fields: dict[str, Any], prefix: tuple[int | str, ...] = ()) -> dict[str, Any]:
    """The router's SamplingParams dict of a front door's fields (None: the default); a value out of
    bounds is a RequestError naming its field, under `prefix` ("sampling" on gRPC)."""
    try:
        return SamplingParams.model_validate({k: v for k, v in fields.items() if v is not None}).model_dump()
    except ValidationError as e:
        raise from_validation_error(e, prefix) from None


# The router's admission errors name a field ("top_p: ...", "prompt_token_ids: ..."): those are the client's.
_ROUTER_FIELDS = frozenset(SamplingParams.model_fields) | {"prompt_token_ids"}


def client_error(e: Exception, prompt_param: str, sampling_prefix: str = "") -> RequestError | None:
    """The router's refusal of bad input as a RequestError in the front door's names; None if not one.

    The router validates again what the front door checked (its own ValueError "field: ..." or a
    SamplingParams ValidationError); a check only it can make is the prompt's ids against the
    target's vocabulary.
    """
    if isinstance(e, ValidationError):
        return from_validation_error(e, (sampling_prefix.rstrip("."),) if sampling_prefix else ())
    field, sep, message = str(e).partition(": ")
    if not (isinstance(e, ValueError) and sep and field in _ROUTER_FIELDS):
        return None
    param = prompt_param if field == "prompt_token_ids" else sampling_prefix + field
    return RequestError(f"{param}: {message}", param=param)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def fit_context(
    n_prompt: int, max_tokens: int | None, default: int | None, window: ContextWindow, prompt_param: str, max_param: str
) -> int:
    """The max_tokens to run with: the client's if prompt + max_tokens fits the window, else an error naming
    the limit (`window.limit`: the model's window or a KV budget, with its config key).

    Unset, it is `default` clipped to the room left, or all the room left when `default` is None.
    """
    room = window.tokens - n_prompt
    if room < 1:
        raise RequestError(
            f"{prompt_param}: {n_prompt} tokens, but the context window is {window.tokens} tokens "
            f"({window.limit}): prompt plus at least one generated token",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return room if default is None else min(default, room)
    if max_tokens > room:
        raise RequestError(
            f"{max_param}: {max_tokens} new tokens plus the {n_prompt}-token prompt exceed the context window of "
            f"{window.tokens} tokens ({window.limit}); at most {room} new tokens fit",
            param=max_param,
            code="context_length_exceeded",
        )
    return max_tokens


class Detokenizer:
    """A request's output text, released as it becomes final.

    Text is decoded incrementally, as vLLM's detokenizer does: each push decodes its new tokens with the
    tokens since the last character boundary before them as context, and keeps what that adds to the
    context's own text, so a chunk costs the same at token 4,000 as at token 5 and the text is the whole
    output's decode (the router's stop check decodes the same way, so a stop string it stopped at is
    found here too). Held back until decided: an incomplete UTF-8 character (decoded as U+FFFD: the
    window waits for its next tokens) and a tail that may be the start of a stop string.

    As vLLM's `include_stop_str_in_output`: off (the default), the text ends before the stop string,
    and a stop token the output ended on (one of `stop_ids`: the request's stop token ids, the
    model's end of sequence) is no part of the text, even where special tokens are not skipped;
    on, both stay in the text. The token ids keep the stop token either way.
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stop: tuple[str, ...] = (),
        include_stop: bool = False,
        stop_ids: frozenset[int] = frozenset(),
    ) -> None:
        self._decode = decode
        self._stop = stop
        self._include_stop = include_stop
        self._stop_ids = stop_ids
        self.token_ids: list[int] = []
        self.sent = 0  # characters of text handed out
        self.text = ""  # the text of token_ids[:_read]
        self._context = 0  # where the decode window starts: a character boundary at most one push back
        self._read = 0  # tokens whose text is in `text`

    def push(self, token_ids: list[int], finish_reason: str | None = None) -> str:
        """The new text after `token_ids`; with a finish_reason, all the rest, cut at a stop string."""
        self.token_ids += token_ids
        ids = self.token_ids
        if finish_reason == "stop" and not self._include_stop and ids and ids[-1] in self._stop_ids:
            ids = ids[:-1]  # the router ends an output on its stop token: the last one
        text = self._read_up_to(ids, final=finish_reason is not None)
        if finish_reason is not None:
            end = self._stop_cut(text) if finish_reason == "stop" else len(text)
        else:
            end = len(text) - self._undecided_tail(text)
        delta = text[self.sent : end]
        self.sent = max(self.sent, end)
        return delta

    def _read_up_to(self, ids: list[int], final: bool) -> str:
        """`text` grown by the tokens of `ids` past `_read`, decoded from the window's start: what they add to the
        window's own text, once it does not end in an incomplete character (or the output is final)."""
        if len(ids) < self._read:  # a stop token already read, dropped from the end: decoded afresh, once
            self.text, self._context, self._read = self._decode(ids), len(ids), len(ids)
            return self.text
        known = self._decode(ids[self._context : self._read])
        grown = self._decode(ids[self._context :])
        if len(grown) > len(known) and (final or not grown.endswith("\ufffd")):
            self.text += grown[len(known) :]
            self._context, self._read = self._read, len(ids)
        return self.text

    def _stop_cut(self, text: str) -> int:
        hits = [(i, len(s)) for i, s in ((text.find(s), s) for s in self._stop) if i >= 0]
        if not hits:
            return len(text)
        start, length = min(hits)
        return max(start + length if self._include_stop else start, self.sent)

    def _undecided_tail(self, text: str) -> int:
        if text.endswith("\ufffd"):
            return len(text) - len(text.rstrip("\ufffd"))
        return marker_start(text, self._stop)


def marker_start(text: str, markers: Sequence[str]) -> int:
    """How many characters at the end of `text` may be the start of one of `markers` (a stop string, a tag a
    parser waits for): the longest such tail, held back until the next text tells."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest
