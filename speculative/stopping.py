"""Stop conditions: end-of-sequence and stop token ids, stop strings, max tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from speculative.sampling import SamplingParams


@dataclass(frozen=True)
class StopCheck:
    """Where a sequence's output ends, if it does."""

    keep: int  # output tokens to keep
    reason: str | None  # "stop" | "length" | None (continue)
    text_end: int | None = None  # for stop strings: cut the decoded text here


def check_stop(
    output: list[int],
    n_new: int,
    params: SamplingParams,
    eos_ids: frozenset[int],
    decode: Callable[[list[int]], str] | None,
) -> StopCheck:
    """Check the last `n_new` tokens of `output`; stop tokens are kept in the ids (as HF does)."""
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    first_new = len(output) - n_new
    for i in range(first_new, len(output)):
        if output[i] in stop_ids:
            return StopCheck(i + 1, "stop")
        if params.stop and decode is not None:
            text = decode(output[: i + 1])
            ends = [text.find(s) for s in params.stop if s in text]
            if ends:
                return StopCheck(i + 1, "stop", min(ends))
        if i + 1 >= params.max_tokens:
            return StopCheck(i + 1, "length")
    return StopCheck(len(output), None)
