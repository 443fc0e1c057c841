"""The same tokens in bfloat16, served: `deploy/local.yaml` as shipped (bfloat16 where the CPU computes it
natively, `target_pool.deterministic: auto`, drafting round ahead with two alternatives per pre-draft)
answers greedy chats with speculation exactly as with `max_draft_tokens: 0`, through the `openai` client.

Without batch-invariant target forwards a verify rounds unlike a one-token step, and such texts part.
"""

from __future__ import annotations

import openai
import pytest
from ray import serve

from deploy.app import build_app
from deploy.config import AppConfig
from speculative.engine.loading import resolve_dtype
from tests.actors.serve_helpers import deploy_yaml, free_port, local_ray, run_app
from tests.fetched import fetched_dir

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(resolve_dtype("auto", "cpu") != "bfloat16", reason="this CPU has no native bfloat16"),
]
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Rename the variable x to count in: x = 0\nfor item in items:\n    x += 1\nprint(x)",
    "Explain what a hash map is in two sentences.",
    "List three colours and say why the sky is blue.",
]
MAX_NEW = 64


def test_local_yaml_in_bfloat16_speculates_to_plain_decodings_text() -> None:
    fetched_dir("qwen-1.5b"), fetched_dir("qwen-0.5b")
    (application,) = deploy_yaml("local.yaml", {})["applications"]
    config = AppConfig.model_validate(application["args"])
    assert config.router().round_ahead and config.router().ahead_alternatives, "round ahead with alternatives"
    port = free_port()
    with local_ray(num_cpus=4):
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        handle = run_app(build_app(config), route_prefix="/", timeout_s=900)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        name = str(config.front_door.served_model_name if config.front_door else config.target_model)
        for text in PROMPTS:  # one at a time: c = 1, round ahead
            texts = [
                client.chat.completions.create(
                    model=name,
                    messages=[{"role": "user", "content": text}],
                    max_tokens=MAX_NEW,
                    temperature=0.0,
                    extra_body=extra,
                )
                .choices[0]
                .message.content
                for extra in ({}, {"max_draft_tokens": 0})
            ]
            assert texts[0] == texts[1], text
        stats = handle.stats.remote().result()
    assert stats["predraft_sequences"] > len(PROMPTS), "pre-drafts beyond the prefill rounds"
