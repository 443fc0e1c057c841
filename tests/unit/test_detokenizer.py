"""The front door's streamed text (`deploy/front/frontdoor.py`: `Detokenizer`), decoded incrementally with the
real tokenizers the shipped models use: the text handed out over a stream is the whole output's decode (cut at
a stop string as before), in any chunking, through incomplete multi-byte characters; and a chunk costs about
the same CPU time at token 4,000 as at token 500 (decoding the whole output each chunk grew with its length).
"""

from __future__ import annotations

import random
import time
from functools import cache

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from deploy.front.frontdoor import Detokenizer
from tests.fetched import fetched_dir

MODELS = ["qwen-0.5b", "smollm2-135m"]
TEXT = (
    'def fib(n: int) -> int:\n    """The n-th Fibonacci number."""\n'
    "    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    "Les élèves ont réussi l'examen — très bien ! 日本語のテキストと絵文字 🚀🔥 mixed in. "
)


@cache
def tokenizer(name: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(fetched_dir(name))


def streamed(detok: Detokenizer, ids: list[int], rng: random.Random, finish: str = "length") -> str:
    """The text handed out pushing `ids` in chunks of 1-4 tokens, the last with `finish`."""
    out, at = [], 0
    while at < len(ids):
        step = rng.randint(1, 4)
        last = at + step >= len(ids)
        out.append(detok.push(ids[at : at + step], finish if last else None))
        at += step
    return "".join(out)


@pytest.mark.parametrize("name", MODELS)
def test_the_streamed_text_is_the_whole_outputs_decode(name: str) -> None:
    tok = tokenizer(name)
    rng = random.Random(7)
    real = tok.encode(TEXT * 3, add_special_tokens=False)
    noise = [rng.randrange(tok.vocab_size) for _ in range(600)]  # split characters, odd bytes, specials
    for ids in (real, noise, real[:40] + noise[:80] + real):
        for skip in (True, False):

            def decode(t: list[int], skip: bool = skip) -> str:
                return tok.decode(t, skip_special_tokens=skip)

            assert streamed(Detokenizer(decode), ids, rng) == decode(ids)
    stop = "Fibonacci"  # the router ends the output on the token that completes it
    end = next(k for k in range(len(real)) if stop in tok.decode(real[:k], skip_special_tokens=True))
    whole = tok.decode(real[:end], skip_special_tokens=True)
    cut = streamed(Detokenizer(lambda t: tok.decode(t, skip_special_tokens=True), (stop,)), real[:end], rng, "stop")
    assert cut == whole[: whole.index(stop)]


@pytest.mark.parametrize("name", MODELS)
def test_a_chunk_costs_the_same_at_4000_tokens_as_at_500(name: str) -> None:
    tok = tokenizer(name)
    ids = (tok.encode(TEXT, add_special_tokens=False) * 200)[:4000]
    detok = Detokenizer(lambda t: tok.decode(t, skip_special_tokens=True), ("<stop never>",))
    cpu: dict[int, float] = {}
    for at in range(0, len(ids), 2):  # chunks of 2 tokens, as a speculating stream's
        start = time.process_time()
        detok.push(ids[at : at + 2])
        cpu[at] = time.process_time() - start

    def per_chunk(end: int) -> float:  # mean over the 200 chunks up to token `end`
        return sum(cpu[a] for a in range(end - 400, end, 2)) / 200

    ratio = per_chunk(4000) / per_chunk(500)
    print(f"{name}: {per_chunk(500) * 1e6:.0f} us a chunk at 500 tokens, {per_chunk(4000) * 1e6:.0f} us at 4,000")
    assert ratio <= 1.5, f"a chunk at 4,000 tokens costs {ratio:.2f}x one at 500"
