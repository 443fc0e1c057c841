"""Structured output on a real model: SmolLM2-135M (fp32, CPU) constrained by a JSON schema.

Greedy constrained output must parse and validate, and speculation (prompt lookup, a draft model)
must emit exactly what plain constrained decoding emits: the grammar mask is one more logits
processor, applied to the target's logits at every node.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from speculative.decoder import SpeculativeDecoder
from speculative.drafters.config import DrafterConfig, drafter_config
from speculative.engine.loading import LoadedModel, load_model
from speculative.engine.runner import ModelRunner
from speculative.planning.depth import DepthConfig
from speculative.rules.grammar import GrammarCompiler
from speculative.rules.sampling import GrammarSpec, SamplingParams
from speculative.target import TargetVerifier
from tests.fetched import fetched_dir
from tests.tiny_models import noisy_copy

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "colours": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "colours"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a person called Alice, aged 30, who likes red and blue, as JSON.",
    "Give me a JSON record for Bob (41), whose favourite colours are green, green and green.",
]
DRAFTERS = {"lookup": drafter_config(kind="lookup"), "model": drafter_config(kind="model", tree_width=2, tree_nodes=8)}


@pytest.fixture(scope="module")
def smollm() -> LoadedModel:
    return load_model(str(fetched_dir("smollm2-135m")), "float32")


@pytest.fixture(scope="module")
def noisy_draft(smollm: LoadedModel) -> torch.nn.Module:
    return noisy_copy(smollm.model, noise=0.02)  # a draft that agrees often, not always


def _prompt(model: LoadedModel, text: str) -> list[int]:
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _decode(model: LoadedModel, draft, config: DrafterConfig | None, params: SamplingParams):
    grammars = GrammarCompiler.from_hf(model.tokenizer)
    drafter = config.build(draft, model.model.config.vocab_size, grammars) if config else None
    decoder = SpeculativeDecoder(
        TargetVerifier(ModelRunner(model.model), grammars=grammars), drafter, DepthConfig(max_depth=4), model.eos_ids
    )
    return decoder.generate([_prompt(model, p) for p in PROMPTS], params)


def test_json_schema_output_validates_and_speculation_changes_nothing(smollm, noisy_draft) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=80, grammar=GrammarSpec(kind="json_schema", text=json.dumps(SCHEMA))
    )
    plain = _decode(smollm, None, None, params)
    for out in plain:
        text = smollm.tokenizer.decode(out.output, skip_special_tokens=True)
        print("constrained:", text)
        assert out.finish_reason == "stop", text  # the grammar completes, then only EOS is allowed
        jsonschema.validate(json.loads(text), SCHEMA)
    for name, config in DRAFTERS.items():
        spec = _decode(smollm, noisy_draft if name == "model" else None, config, params)
        assert [o.output for o in spec] == [o.output for o in plain], name
        steps = sum(o.stats.steps for o in spec)
        print(f"{name}: tokens per target step {sum(len(o.output) for o in spec) / steps:.2f}")
