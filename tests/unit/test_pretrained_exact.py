"""Greedy exactness on real pretrained models (docs/models.md): SmolLM2-135M and the Qwen2.5-Coder pair.

fp32, against each target's own `generate(do_sample=False)`. `make test` fetches the models first.
"""

from __future__ import annotations

import pytest
import torch

from speculative.decoder import SpeculativeDecoder
from speculative.drafters.config import drafter_config
from speculative.engine.loading import LoadedModel, load_model
from speculative.engine.runner import ModelRunner
from speculative.planning.depth import DepthConfig
from speculative.target import TargetVerifier
from tests.fetched import fetched_dir

pytestmark = pytest.mark.slow

USER_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Rename the variable x to count in: x = 0\nfor item in items:\n    x += 1\nprint(x)",
    "List three colours.",
]
DRAFTERS = {
    "chain": drafter_config(kind="model"),
    "tree": drafter_config(kind="model", tree_width=2, tree_nodes=8),
    "lookup": drafter_config(kind="lookup"),
}


def fetched(name: str) -> LoadedModel:
    return load_model(str(fetched_dir(name)), "float32")


def chat_ids(model: LoadedModel, text: str) -> list[int]:
    ids = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def reference(model: LoadedModel, prompt: list[int], n: int) -> list[int]:
    out = model.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def check_exact(
    target: LoadedModel,
    draft_model,
    new_tokens: int,
    prompts: list[list[int]],
    drafters: tuple[str, ...] = tuple(DRAFTERS),
) -> dict[str, float]:
    from speculative.rules.sampling import SamplingParams

    refs = [reference(target, p, new_tokens) for p in prompts]
    acceptance = {}
    for name in drafters:
        config = DRAFTERS[name]
        decoder = SpeculativeDecoder(
            TargetVerifier(ModelRunner(target.model)),
            config.build(draft_model, target.model.config.vocab_size),
            DepthConfig(max_depth=4),
            eos_ids=target.eos_ids,
        )
        outs = decoder.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens))
        assert [o.output for o in outs] == refs, f"{name} drafter differs from generate()"
        acceptance[name] = sum(o.stats.accepted + o.stats.steps for o in outs) / sum(o.stats.steps for o in outs)
    return acceptance


def test_smollm2_with_lookup():
    """deploy/smoke.yaml's setup: SmolLM2 drafted by prompt lookup alone (no draft model)."""
    target = fetched("smollm2-135m")
    prompts = [chat_ids(target, p) for p in USER_PROMPTS]
    acceptance = check_exact(target, None, 32, prompts, drafters=("lookup",))
    print("smollm2 acceptance length", acceptance)


def test_qwen_pair():
    target = fetched("qwen-1.5b")
    draft = fetched("qwen-0.5b")
    prompts = [chat_ids(target, p) for p in USER_PROMPTS[:2]]
    acceptance = check_exact(target, draft.model, 24, prompts)
    print("qwen acceptance length", acceptance)
    assert acceptance["chain"] > 1.5  # a real same-tokenizer pair agrees most of the time
