"""The shipped `deploy/local.yaml` in float32 through Serve's HTTP proxy: the Qwen2.5-Coder pair drafting
round ahead gives the target's own greedy tokens, hits and misses alike.

The YAML's application as shipped, but for the dtype (float32: exactness, not speed), the target's weights
dense (`target_weights: dequantized`: the reference is the Hugging Face model itself) and depth by
acceptance alone (in float32 a several-token forward costs about two one-token steps on a CPU, so
the load planner would rightly draft little, and this test is about the rounds that do). The
reference is HF `generate(do_sample=False)` on the same chat-templated prompt ids, the model's Linear
layers on the YAML's kernels (`cpu_linear`), as the target replica holds them.
"""

from __future__ import annotations

import openai
import pytest
import torch
from ray import serve

from deploy.app import build_app
from deploy.config import AppConfig
from speculative.engine.cpu.onednn_linear import packed
from tests.actors.serve_helpers import deploy_yaml, free_port, local_ray, run_app
from tests.fetched import fetched_dir, free_memory

pytestmark = pytest.mark.slow
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a short paragraph about why the sky is blue.",
]
MAX_NEW = 24


def _models() -> tuple[str, str]:
    return str(fetched_dir("qwen-1.5b")), str(fetched_dir("qwen-0.5b"))


def _references(target: str, cpu_linear: str) -> list[list[int]]:
    """Each prompt's greedy continuation by the target alone (the model is freed after)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    model = packed(AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval(), cpu_linear)
    outs = []
    for text in PROMPTS:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        ids = list(tokenizer.encode(str(rendered), add_special_tokens=False))
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW)
        outs.append(out[0, len(ids) :].tolist())
    del model
    free_memory()
    return outs


def test_local_yaml_round_ahead_greedy_identical_to_the_target_alone() -> None:
    target, _ = _models()
    shipped = deploy_yaml(
        "local.yaml", {"dtype": "float32", "target_weights": "dequantized", "speculation": {"load_adaptive": False}}
    )
    (application,) = shipped["applications"]
    config = AppConfig.model_validate(application["args"])
    expected = _references(target, config.cpu_linear)
    assert config.router().round_ahead, "the shipped YAML drafts round ahead"
    port = free_port()
    with local_ray(num_cpus=4):
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        handle = run_app(build_app(config), route_prefix="/", timeout_s=900)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        name = config.front_door.served_model_name if config.front_door else config.target_model
        for text, want in zip(PROMPTS, expected, strict=True):  # one at a time: c = 1, round ahead
            done = client.chat.completions.create(
                model=str(name),
                messages=[{"role": "user", "content": text}],
                max_tokens=MAX_NEW,
                temperature=0.0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            assert done.choices[0].model_extra["token_ids"] == want, text
        stats = handle.stats.remote().result()
    print({k: stats[k] for k in ("predraft_sequences", "predraft_hit_rate", "draft_tokens_unverified")})
    assert stats["predraft_sequences"] > len(PROMPTS), "pre-drafts beyond the prefill rounds"
    assert 0.0 < stats["predraft_hit_rate"] < 1.0, "rounds whose pre-draft hit and rounds whose pre-draft missed"
