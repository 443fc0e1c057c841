"""Stop strings are matched in a bounded tail of the output, with the whole-text rule's results."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from transformers import AutoTokenizer

from speculative.rules.sampling import SamplingParams
from speculative.rules.stopping import StopCheck, check_stop
from tests.fetched import fetched_dir

TEXT = (
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    "Voilà: naïve café, 東京 and Zürich — “quoted” text, emoji 🙂🚀, tabs\tand  double  spaces.\n"
)


def whole_text_rule(output: list[int], n_new: int, stops: list[str], decode: Callable[[list[int]], str]) -> StopCheck:
    """The rule stated plainly: after each new token, look for the stops in the whole decoded output."""
    for i in range(len(output) - n_new, len(output)):
        text = decode(output[: i + 1])
        ends = [text.find(s) for s in stops if s in text]
        if ends:
            return StopCheck(i + 1, "stop", min(ends))
    return StopCheck(len(output), None)


@pytest.mark.parametrize("name", ["qwen-0.5b", "smollm2-135m"])
def test_tail_matching_finds_what_the_whole_text_rule_finds(name: str) -> None:
    """Random outputs (real text, then random token ids: split characters, odd bytes), committed a few
    tokens at a time, with stop strings cut from their own text: the same stop, at the same token and
    the same place in the text, as decoding the whole output after every token."""
    tokenizer = AutoTokenizer.from_pretrained(fetched_dir(name))

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    rng = random.Random(0)
    real = tokenizer(TEXT * 3, add_special_tokens=False)["input_ids"]
    for trial in range(60):
        noise = [rng.randrange(len(tokenizer)) for _ in range(150)]
        ids = real[rng.randrange(len(real) // 2) :] if trial % 2 else noise
        text = decode(ids)
        at = rng.randrange(len(text) - 12)
        stops = [text[at : at + rng.randint(1, 12)], "never in it \x00"]
        params = SamplingParams(temperature=0.0, max_tokens=10_000, stop=stops)
        output: list[int] = []
        while len(output) < len(ids):
            new = ids[len(output) : len(output) + rng.randint(1, 5)]
            output += new
            got = check_stop(output, len(new), params, frozenset(), decode)
            assert got == whole_text_rule(output, len(new), stops, decode), (name, trial, stops)
            if got.reason:
                break


def test_a_step_decodes_a_tail_bounded_by_the_longest_stop_not_the_output() -> None:
    """20,000 tokens in, a step still decodes about (longest stop + margin) tokens, not the output."""
    decoded: list[int] = []

    def decode(ids: list[int]) -> str:
        decoded.append(len(ids))
        return "".join("#" if t < 0 else chr(97 + t % 26) for t in ids)

    params = SamplingParams(temperature=0.0, max_tokens=100_000, stop=["#####"])
    output = list(range(20_000))
    assert check_stop(output, 4, params, frozenset(), decode).reason is None
    assert max(decoded) <= 4 + 2 * (5 + 8)
    decoded.clear()
    output += [-1] * 5  # "#####"
    check = check_stop(output, 5, params, frozenset(), decode)
    assert check == StopCheck(20_005, "stop", 20_000)
