"""A short request during a long prompt's prefill, on `make run`'s server: the shipped `deploy/local.yaml`
(the Qwen2.5-Coder pair, as `make run` starts it: embedded Ray, the target on its own core).

A 16-token chat completion sent while a 4,000-token prompt is being prefilled finishes within 3x its time
alone, and the long prompt completes. The long prompt's chunks are sized by the YAML's
`target_pool.prefill_round_factor`: a forward carrying one beside the short request's rows takes at most
1.5x their round alone, by the forwards the replica measured (speculative/planning/chunking.py); the short
prompt's own catch-up goes first (the shortest catch-ups first).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from deploy.local.demo import DEFAULT_CONFIG, app_block, deploy_local, start_local_ray, stop_local_ray
from tests.actors.serve_helpers import REPO, free_port
from tests.fetched import fetched_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
LONG_TOKENS = 4_000
SHORT = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]


def long_prompt() -> list[int]:
    """4,000 tokens of real code: a module of small functions, as tokenized by the target's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(fetched_dir("qwen-1.5b")))
    text = "".join(f"def scale_{i}(values):\n    return [v * {i} + {i % 7} for v in values]\n\n" for i in range(800))
    ids = list(tokenizer.encode(text))
    assert len(ids) >= LONG_TOKENS
    return ids[:LONG_TOKENS]


def short_request(client: openai.OpenAI, model: str) -> float:
    """Seconds for the 16-token chat completion, to its last token."""
    start = time.perf_counter()
    done = client.chat.completions.create(
        model=model,
        messages=SHORT,
        max_tokens=16,
        temperature=0.0,
        extra_body={"ignore_eos": True},  # type: ignore[arg-type]
    )
    assert done.usage is not None and done.usage.completion_tokens == 16
    return time.perf_counter() - start


def test_a_short_request_during_a_4000_token_prefill_takes_at_most_3x_its_time_alone(tmp_path: Path) -> None:
    _, args = app_block(DEFAULT_CONFIG)
    ids = long_prompt()
    found: dict[str, Any] = {}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", REPO)  # the workers import this checkout, not an installed copy
        start_local_ray(args, metrics_port=free_port())
        try:
            url = deploy_local(args, free_port())
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=1200)
            model = args["front_door"]["served_model_name"]
            alone = min(short_request(client, model) for _ in range(3))  # warm: the first compiles and measures

            def long_request() -> None:
                started = time.perf_counter()
                done = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0.0)
                found["long"] = (done, time.perf_counter() - started)

            long = threading.Thread(target=long_request)
            long.start()
            time.sleep(5.0)  # admitted, and some chunks into its prefill
            during = short_request(client, model)
            still_prefilling = long.is_alive()
            long.join(timeout=1200)
        finally:
            stop_local_ray()
    done, long_s = found["long"]
    print(
        f"16 tokens alone {alone:.2f} s, during the prefill {during:.2f} s ({during / alone:.2f}x); "
        f"{LONG_TOKENS}-token prompt + 4 tokens {long_s:.1f} s"
    )
    assert still_prefilling, "the short request finished while the long prompt was still being prefilled"
    assert done.usage.prompt_tokens == LONG_TOKENS and done.usage.completion_tokens == 4
    assert during <= 3 * alone, f"{during:.2f} s during the prefill against {alone:.2f} s alone"
