"""Stop conditions: end-of-sequence and stop token ids, stop strings, max tokens.

Stop strings are matched in the decoded tail of the output, not the whole of it: a stop string
that completes in this step's new tokens starts at most len(stop) - 1 characters before them, so
a tail holding the new tokens and at least longest-stop + STOP_MARGIN characters before them sees
every such match. The cost of a step is bounded by the longest stop string, whatever the output's
length (the router checks stops on its event loop, every step of every sequence). Only when the
tail holds a stop string is the whole output decoded once, to place the cut in its text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from speculative.rules.sampling import SamplingParams

# Characters of tail kept beyond the longest stop string: the first characters a decoder gives a
# piece of text cut out of the middle can differ from those of the whole (a SentencePiece leading
# space dropped, a multi-byte character cut into replacement characters).
STOP_MARGIN = 8


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
    strings = params.stop if decode is not None else []
    start = tail_start(output, first_new, max(map(len, strings)) + STOP_MARGIN, decode) if strings and decode else 0
    for i in range(first_new, len(output)):
        if output[i] in stop_ids:
            return StopCheck(i + 1, "stop")
        if strings and decode is not None and any(s in decode(output[start : i + 1]) for s in strings):
            text = decode(output[: i + 1])  # where the stop falls in the whole text: once per sequence
            ends = [text.find(s) for s in strings if s in text]
            if ends:
                return StopCheck(i + 1, "stop", min(ends))
        if i + 1 >= params.max_tokens:
            return StopCheck(i + 1, "length")
    return StopCheck(len(output), None)


def tail_start(output: list[int], end: int, chars: int, decode: Callable[[list[int]], str]) -> int:
    """The latest index from which output[index:end] decodes to at least `chars` characters (0 if the
    whole does not): tokens are taken back `chars` at a time, doubling, since most decode to a
    character or more."""
    start, step = end, max(chars, 1)
    while start > 0:
        start = max(start - step, 0)
        if len(decode(output[start:end])) >= chars:
            return start
        step *= 2
    return 0
