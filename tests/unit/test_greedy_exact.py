"""Greedy speculative output is token-identical to the target's own generate(do_sample=False), fp32."""

from __future__ import annotations

import copy

import pytest
import torch

from speculative.decoder import Planning, SpeculativeDecoder
from speculative.drafters.config import drafter_config
from speculative.drafters.lookup import PromptLookupDrafter, lookup_match
from speculative.engine.loading import quantized
from speculative.engine.runner import ModelRunner
from speculative.planning.costs import StepCosts
from speculative.planning.depth import DepthConfig
from speculative.planning.load_control import QUOTE_RUN
from speculative.rules.sampling import SamplingParams
from speculative.target import TargetVerifier
from tests.tiny_models import ARCHS, VOCAB, joined_mid_stream, noisy_copy, reference_greedy, tiny_model

NEW = 24
# Different lengths; repeated n-grams so prompt lookup finds matches.
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6],
    [11, 12],
    [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 20, 21, 22, 23, 24, 25, 40, 41, 42],
    [7],
]
DRAFTERS = {
    "chain": drafter_config(kind="model"),
    "tree": drafter_config(kind="model", tree_width=3, tree_nodes=12),
    "lookup": drafter_config(kind="lookup"),
    "hybrid": drafter_config(kind="hybrid"),
    "none": drafter_config(kind="none"),
}


@pytest.fixture(scope="module", params=ARCHS)
def models(request):
    target = tiny_model(request.param)
    draft = noisy_copy(target, noise=0.2)
    refs = [reference_greedy(target, p, NEW) for p in PROMPTS]
    return target, draft, refs


def decoder(
    target,
    draft,
    drafter: str,
    max_depth: int = 4,
    adaptive: bool = True,
    costs: StepCosts | None = None,
    lookup_quotes: bool = False,
) -> SpeculativeDecoder:
    config = DRAFTERS[drafter]
    return SpeculativeDecoder(
        TargetVerifier(ModelRunner(target)),
        config.build(draft, VOCAB),
        DepthConfig(max_depth=max_depth, adaptive=adaptive),
        planning=Planning(
            costs, lookup_quotes=PromptLookupDrafter(config.max_ngram, config.min_ngram) if lookup_quotes else None
        ),
    )


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW)


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_batch_of_one_matches_generate(models, drafter):
    target, draft, refs = models
    for prompt, ref in zip(PROMPTS, refs, strict=True):
        (out,) = decoder(target, draft, drafter).generate([prompt], GREEDY)
        assert out.output == ref
        assert out.finish_reason == "length"


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_mixed_batch_matches_generate(models, drafter):
    target, draft, refs = models
    outs = decoder(target, draft, drafter).generate(PROMPTS, GREEDY)
    assert [o.output for o in outs] == refs


@pytest.mark.parametrize("drafter", ["chain", "tree", "hybrid", "lookup"])
def test_depths_capped_by_measured_costs_stay_exact(models, drafter):
    """With measured-cost caps (load_control.py) depths follow timing (and, for lookup, each
    sequence's match); the tokens must not."""
    target, draft, refs = models
    costs = StepCosts()
    outs = decoder(target, draft, drafter, costs=costs).generate(PROMPTS, GREEDY)
    assert [o.output for o in outs] == refs
    assert costs.verify.points  # it measured, so caps were in force
    assert costs.draft_step.points or drafter == "lookup"  # (lookup drafts cost nothing: no draft side)


@pytest.mark.parametrize("drafter", ["chain", "tree"])
def test_quotes_drafted_by_lookup_beside_a_draft_model_stay_exact(models, drafter):
    """Beside a draft model, a sequence whose context ends in a quote (here the tiny targets' loops, which
    repeat their own output) drafts by prompt lookup, the rest by the model, in one batch: the tokens
    are the target's alone, and lookup's drafts were verified and landed."""
    target, draft, refs = models
    outs = decoder(target, draft, drafter, costs=StepCosts(), lookup_quotes=True).generate(PROMPTS, GREEDY)
    assert [o.output for o in outs] == refs
    landed = [accepted for o in outs for run, (accepted, _) in o.stats.lookup_tally.items() if run >= QUOTE_RUN]
    quoting = [  # where a quote's next token is the target's, a lookup draft would land
        len(r) - i
        for p, r in zip(PROMPTS, refs, strict=True)
        for i in range(1, len(r) - 1)
        if (m := lookup_match(torch.tensor(p + r[:i]), 3, 1, 1))[0] >= QUOTE_RUN and m[1] == [r[i]]
    ]
    if max(quoting, default=0) > 2:  # with room left to draft (llama and gpt2 loop; qwen2 hardly does)
        assert landed and max(landed) > 0


@pytest.mark.parametrize("drafter", ["chain", "tree"])
def test_fixed_depth_accepts_drafts_and_stays_exact(models, drafter):
    """Without adaptation every step drafts 6 deep: exactness must not depend on the depth."""
    target, draft, refs = models
    outs = decoder(target, draft, drafter, max_depth=6, adaptive=False).generate(PROMPTS, GREEDY)
    assert [o.output for o in outs] == refs
    assert sum(o.stats.accepted for o in outs) > 0  # the noisy draft agrees sometimes


def test_sequences_joining_mid_stream_stay_exact(models):
    """Continuous batching: sequences added while others are half-way give the same tokens."""
    target, draft, refs = models
    assert joined_mid_stream(decoder(target, draft, "tree"), PROMPTS, GREEDY) == refs


def test_perfect_draft_accepts_everything():
    """A draft identical to the target is always accepted: acceptance length = depth + 1."""
    target = tiny_model("llama")
    dec = SpeculativeDecoder(
        TargetVerifier(ModelRunner(target)),
        drafter_config(kind="model").build(target, VOCAB),
        DepthConfig(max_depth=3, adaptive=False),
    )
    (out,) = dec.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=17))
    assert out.output == reference_greedy(target, PROMPTS[0], 17)
    assert out.stats.steps == 5  # 4 steps of 4 tokens + 1 (max_tokens caps the last depth)
    assert out.stats.accepted == 12


@pytest.mark.parametrize("quantize", ["int8", "int4"])
@pytest.mark.parametrize("drafter", ["chain", "tree"])
def test_quantized_draft_stays_exact(models, drafter, quantize):
    """A draft with int8 or int4 Linear weights (`draft_quantize: auto`, the CPU default, picks one) proposes
    tokens the target accepts, and the output is still the target's own, batch of one and mixed."""
    target, _, refs = models
    draft = copy.deepcopy(target).to(torch.float32 if quantize == "int8" else torch.bfloat16)
    draft = quantized(draft, quantize)
    assert not any(isinstance(m, torch.nn.Linear) for m in draft.modules())  # every Linear is quantized now
    for prompt, ref in zip(PROMPTS, refs, strict=True):
        (out,) = decoder(target, draft, drafter, max_depth=4, adaptive=False).generate([prompt], GREEDY)
        assert out.output == ref
    outs = decoder(target, draft, drafter, max_depth=4, adaptive=False).generate(PROMPTS, GREEDY)
    assert [o.output for o in outs] == refs
    assert sum(o.stats.accepted for o in outs) > 0  # a quantized copy of the target mostly agrees with it


def test_int8_needs_a_float32_cpu_model():
    with pytest.raises(ValueError, match="float32"):
        quantized(tiny_model("llama").to(torch.bfloat16), "int8")
    with pytest.raises(ValueError, match="quantize"):
        quantized(tiny_model("llama"), "int5")
