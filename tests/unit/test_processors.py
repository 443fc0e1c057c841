"""Logits processors and logprobs under speculation: the same tokens, and the same log probabilities,
as plain decoding with them, and both as a step-by-step reference loop computes them (fp32)."""

from __future__ import annotations

import pytest
import torch

from speculative.decoder import SpeculativeDecoder
from speculative.drafters.config import drafter_config
from speculative.engine.runner import ModelRunner
from speculative.planning.depth import DepthConfig
from speculative.rules.sampling import SamplingParams
from speculative.target import TargetVerifier
from tests.tiny_models import VOCAB, noisy_copy, tiny_model

NEW = 20
EOS = 1
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [11, 12, 13], [20, 21, 22, 20, 21, 22, 20]]
DRAFTERS = {
    "chain": drafter_config(kind="model"),
    "tree": drafter_config(kind="model", tree_width=3, tree_nodes=12),
    "lookup": drafter_config(kind="lookup"),
}
PROCESSED = {
    "presence-frequency": {"presence_penalty": 1.5, "frequency_penalty": 0.7},
    "logit-bias": {"logit_bias": ((9, 8.0), (6, -50.0), (40, 3.0))},
    "min-tokens": {"min_tokens": 12, "stop_token_ids": (30,)},
    "all": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3, "logit_bias": ((9, 4.0),)},
}


@pytest.fixture(scope="module")
def models():
    target = tiny_model("llama")
    with torch.no_grad():  # make the end token and stop id likely, so min_tokens has something to hold back
        target.get_output_embeddings().weight[EOS] *= 1.6
        target.get_output_embeddings().weight[30] *= 1.6
    return target, noisy_copy(target, noise=0.2)


def run(
    target, draft, drafter: str | None, params: SamplingParams, depth: int = 4, sampled: bool = True
) -> tuple[list[list[int]], SpeculativeDecoder]:
    config = DRAFTERS[drafter].model_copy(update={"sampled": sampled}) if drafter else None
    built = config.build(draft, VOCAB) if config else None
    if built is not None and hasattr(built, "eos_ids"):
        built.eos_ids = frozenset({EOS})
    verifier = TargetVerifier(ModelRunner(target), eos_ids=frozenset({EOS}))
    dec = SpeculativeDecoder(verifier, built, DepthConfig(max_depth=depth, adaptive=False), eos_ids=frozenset({EOS}))
    return [s.output for s in dec.generate(PROMPTS, params)], dec


def reference(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding one full forward per token, the processors written out as documented."""
    out: list[int] = []
    ending = {EOS, *params.stop_token_ids}
    while len(out) < params.max_tokens:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].clone()  # [V]
        if len(out) < params.min_tokens:
            logits[list(ending)] = float("-inf")
        for token, bias in params.logit_bias:
            logits[token] += bias
        for token in set(prompt + out):
            if params.repetition_penalty != 1.0:
                value = logits[token]
                logits[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
        for token in set(out):
            logits[token] -= params.frequency_penalty * out.count(token) + params.presence_penalty
        out.append(int(logits.argmax()))
        if out[-1] in ending:
            break
    return out


def verified_drafts(seqs, drafter: str) -> bool:
    """Drafts went through verification: accepted ones for a draft model; for prompt lookup, which
    meets few repeats once penalties or sampling discourage them, proposed ones."""
    return any(s.stats.drafted if drafter == "lookup" else s.stats.accepted for s in seqs)


@pytest.mark.parametrize("setting", list(PROCESSED))
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_with_processors_equals_the_reference(models, drafter, setting):
    target, draft = models
    params = SamplingParams(temperature=0.0, max_tokens=NEW, **PROCESSED[setting])
    expected = [reference(target, p, params) for p in PROMPTS]
    plain, _ = run(target, draft, None, params)
    speculated, dec = run(target, draft, drafter, params)
    assert plain == expected
    assert speculated == expected
    assert verified_drafts(dec.finished, drafter), "no draft was verified: the test proves nothing"
    unprocessed, _ = run(target, draft, None, SamplingParams(temperature=0.0, max_tokens=NEW))
    assert unprocessed != expected, "the processors changed nothing: the test proves nothing"


def test_min_tokens_holds_the_end_back(models):
    target, draft = models
    params = SamplingParams(temperature=0.0, max_tokens=NEW, stop_token_ids=(30,))
    free, _ = run(target, draft, "chain", params)
    held, _ = run(target, draft, "chain", params.model_copy(update={"min_tokens": 12}))
    assert any(len(o) < 12 and o[-1] in (EOS, 30) for o in free)  # the end comes early without it
    assert all(len(o) >= 12 for o in held)


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_min_p_sampled_with_deterministic_drafts_equals_plain(models, drafter):
    """Keyed sampling: with drafts that are not sampled (lookup, top-k trees) a seeded sampled stream
    is the same tokens with and without speculation, min-p and penalties included."""
    target, draft = models
    params = SamplingParams(temperature=0.9, min_p=0.05, presence_penalty=0.4, max_tokens=NEW, seed=7)
    plain, _ = run(target, draft, None, params)
    speculated, dec = run(target, draft, drafter, params, sampled=False)
    assert speculated == plain
    assert any(s.stats.drafted for s in dec.finished)


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_equal_plain_decoding_and_the_model(models, drafter, temperature):
    """Each token's log probability (and its top 5) with speculation equals plain decoding's, to 1e-5,
    and the model's own log_softmax at that position: the raw distribution, before temperature."""
    target, draft = models
    params = SamplingParams(temperature=temperature, max_tokens=NEW, seed=3, logprobs=5)
    config = DRAFTERS[drafter].model_copy(update={"sampled": False})
    dec = SpeculativeDecoder(TargetVerifier(ModelRunner(target)), config.build(draft, VOCAB), DepthConfig(max_depth=4))
    speculated = dec.generate(PROMPTS, params)
    plain = SpeculativeDecoder(TargetVerifier(ModelRunner(target)), None, DepthConfig()).generate(PROMPTS, params)
    assert verified_drafts(speculated, drafter)
    for prompt, spec, base in zip(PROMPTS, speculated, plain, strict=True):
        assert spec.output == base.output and len(spec.logprobs) == len(spec.output)
        with torch.no_grad():
            full = target(torch.tensor([prompt + spec.output])).logits[0].log_softmax(-1)  # [n, V]
        for i, (a, b) in enumerate(zip(spec.logprobs, base.logprobs, strict=True)):
            assert a.token == b.token == spec.output[i]
            assert abs(a.logprob - b.logprob) < 1e-5
            assert abs(a.logprob - float(full[len(prompt) + i - 1, a.token])) < 1e-5
            assert [t for t, _ in a.top] == [t for t, _ in b.top] == full[len(prompt) + i - 1].topk(5).indices.tolist()
            assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top, strict=True)) < 1e-5


def test_logprobs_are_cut_with_the_output_at_a_stop(models):
    target, draft = models
    params = SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=0, stop_token_ids=(30,))
    outputs, dec = run(target, draft, "chain", params)
    assert any(o[-1] in (EOS, 30) and len(o) < NEW for o in outputs)  # some stop cut a step's tokens
    for seq in dec.finished:
        assert [lp.token for lp in seq.logprobs] == seq.output
        assert all(lp.top == () for lp in seq.logprobs)
