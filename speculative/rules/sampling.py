"""Sampling parameters and the logits -> probabilities transforms.

The same functions run on the draft's logits and on the target's, so `p` and `q` at a tree node
are always transformed identically, which the acceptance rules require. Order, as in vLLM: the
request's logits processors (`processing.py`: min_tokens, logit_bias, penalties, grammar mask), temperature,
min-p, top-k, top-p.
"""

from __future__ import annotations

import json
import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator


class GrammarSpec(BaseModel):
    """A constraint on the output (structured output): what `speculative/rules/grammar.py` compiles."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["json_object", "json_schema", "regex", "lark"] = Field(
        description="json_object: any JSON object; json_schema: JSON valid under `text`; regex / lark: "
        "output matching the regular expression / Lark grammar `text`."
    )
    text: str = Field("", max_length=1_000_000, description="The schema (JSON), regex or Lark grammar.")

    @model_validator(mode="after")
    def _text_fits_kind(self) -> GrammarSpec:
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except ValueError as e:
                raise ValueError(f"grammar: the schema is not JSON ({e})") from None
            if not isinstance(schema, dict | bool):
                raise ValueError("grammar: a JSON schema is an object or a boolean")
        elif self.kind in ("regex", "lark") and not self.text:
            raise ValueError(f"grammar: a {self.kind} grammar needs its text")
        return self


class SamplingParams(BaseModel):
    """How one request turns the target's logits into tokens."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(
        1.0, ge=0.0, le=100.0, description="0 means greedy (argmax); > 0 samples from softmax(l/T)."
    )
    top_k: int = Field(0, ge=0, le=1_000_000, description="Keep the k most likely tokens; 0 keeps all.")
    top_p: float = Field(
        1.0, gt=0.0, le=1.0, description="Keep the smallest set of most likely tokens with mass >= top_p."
    )
    repetition_penalty: float = Field(
        1.0,
        ge=0.01,
        le=10.0,
        description="HF/CTRL penalty on tokens already in prompt or output; 1 = off. At least 0.01: dividing "
        "logits by less overflows them.",
    )
    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Subtracted from the logit of every token already in the output."
    )
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Subtracted from a token's logit once per time it is in the output."
    )
    logit_bias: tuple[tuple[int, float], ...] = Field(
        (), max_length=1024, description="(token id, bias) pairs added to the logits before sampling."
    )
    min_p: float = Field(
        0.0, ge=0.0, le=1.0, description="Drop tokens less likely than min_p x the most likely one (after T)."
    )
    min_tokens: int = Field(0, ge=0, le=1_000_000, description="End tokens and stop ids banned until this many.")
    logprobs: int | None = Field(
        None, ge=0, le=20, description="Return each token's log probability and this many top alternatives."
    )
    max_tokens: int = Field(16, ge=1, le=1_000_000, description="Most new tokens to generate.")
    stop_token_ids: tuple[int, ...] = Field((), description="Extra token ids that end the sequence.")
    stop: tuple[str, ...] = Field((), max_length=16, description="Strings that end the sequence (cut from text).")
    ignore_eos: bool = Field(False, description="Keep generating past the model's end-of-sequence token.")
    seed: int = Field(0, ge=0, lt=2**63, description="Keys the counter-based generator of this request.")
    grammar: GrammarSpec | None = Field(
        None, description="Constrain the output to this grammar (masks every node's distribution)."
    )
    max_draft_tokens: int | None = Field(
        None,
        ge=0,
        le=64,
        description="Most draft tokens per step for this request (0: plain decoding, no speculation); "
        "None: as many as the server's speculation chooses.",
    )
    prediction: tuple[int, ...] = Field(
        (),
        max_length=1_000_000,
        description="Token ids the output is expected to repeat (OpenAI's Predicted Outputs): prompt lookup drafts "
        "from them as from the context. Drafts only: the output is the same with or without them.",
    )

    @model_validator(mode="after")
    def _stops_non_empty(self) -> SamplingParams:
        if any(s == "" for s in self.stop):
            raise ValueError("stop: stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids: token ids must be >= 0")
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in self.logit_bias):
            raise ValueError("logit_bias: token ids must be >= 0 and biases within -100..100")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: {self.min_tokens} is more than max_tokens ({self.max_tokens})")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalty(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def apply_repetition_penalty(
    logits: torch.Tensor,  # [N, V]
    seen: torch.Tensor,  # [N, V] bool: token already in the context of that row
    penalty: float,
) -> torch.Tensor:  # [N, V]
    """CTRL / HF repetition penalty: seen logits > 0 are divided by it, the others multiplied."""
    if penalty == 1.0:
        return logits
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, scaled, logits)


def probs_from_logits(
    logits: torch.Tensor,  # [N, V], penalty already applied
    params: SamplingParams,
) -> torch.Tensor:  # [N, V] float32, rows sum to 1
    """Temperature, top-k and top-p, then softmax. Greedy gives a one-hot at the argmax."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits - logits.max(-1, keepdim=True).values  # softmax is shift-invariant; a tiny T cannot overflow
    logits = logits / max(params.temperature, torch.finfo(logits.dtype).tiny)  # T below float32's least: not 0/0
    vocab = logits.shape[-1]
    if params.min_p > 0.0:  # p(x) < min_p * p_max  <=>  logit(x) < logit_max + log(min_p) (logits shifted: max 0)
        logits = logits.masked_fill(logits < math.log(params.min_p), float("-inf"))
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [N, V]
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # [N, V] mass of strictly better tokens
        drop_sorted = mass_before >= params.top_p  # [N, V]
        drop_sorted[..., 0] = False  # the most likely token is always kept (a top_p below float32's least does too)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def context_seen(
    context_ids: list[int],
    paths: list[list[int]],  # per row: draft tokens between the context and that row's position
    vocab: int,
) -> torch.Tensor:  # [len(paths), V] bool
    """Which tokens each row has already seen: the context plus the row's own path."""
    seen = torch.zeros(len(paths), vocab, dtype=torch.bool)
    if context_ids:
        seen[:, torch.tensor(context_ids, dtype=torch.long)] = True
    for row, path in enumerate(paths):
        if path:
            seen[row, torch.tensor(path, dtype=torch.long)] = True
    return seen
