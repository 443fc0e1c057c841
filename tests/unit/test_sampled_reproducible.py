"""Seeded sampling reproduces; a batch gives the tokens its sequences give alone; stop conditions."""

from __future__ import annotations

import pytest

from speculative.decoder import SpeculativeDecoder
from speculative.drafters.config import DrafterConfig, drafter_config
from speculative.engine.runner import ModelRunner
from speculative.planning.depth import DepthConfig
from speculative.rules.sampling import SamplingParams
from speculative.target import TargetVerifier
from tests.tiny_models import VOCAB, noisy_copy, reference_greedy, tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [11, 12], [20, 21, 22, 23, 24, 25, 26, 20, 21, 22]]
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, max_tokens=20, seed=1234)


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("qwen2")
    return target, noisy_copy(target, noise=0.2)


def run(pair, config: DrafterConfig, prompts, params) -> list[list[int]]:
    target, draft = pair
    dec = SpeculativeDecoder(TargetVerifier(ModelRunner(target)), config.build(draft, VOCAB), DepthConfig(max_depth=4))
    plist = params if isinstance(params, list) else [params] * len(prompts)
    return [s.output for s in dec.generate(prompts, plist)]


CONFIGS = {
    "chain-rejection": drafter_config(kind="model"),
    "tree-rejection": drafter_config(kind="model", tree_width=2, tree_nodes=8),
    "tree-topk": drafter_config(kind="model", tree_width=3, tree_nodes=12, sampled=False),
    "lookup": drafter_config(kind="lookup"),
    "hybrid": drafter_config(kind="hybrid"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_seeded_runs_reproduce_and_batch_equals_alone(pair, name):
    seeds = [SAMPLED.model_copy(update={"seed": s}) for s in (1, 2, 3)]
    batch = run(pair, CONFIGS[name], PROMPTS, seeds)
    again = run(pair, CONFIGS[name], PROMPTS, seeds)
    alone = [run(pair, CONFIGS[name], [p], [s])[0] for p, s in zip(PROMPTS, seeds, strict=True)]
    assert batch == again == alone
    other_seed = run(pair, CONFIGS[name], PROMPTS[:1], [SAMPLED.model_copy(update={"seed": 99})])
    assert other_seed[0] != batch[0]


def test_deterministic_drafts_give_plain_sampling_output(pair):
    """Target-sample matching emits exactly what plain sampling with the same seed emits."""
    plain = run(pair, drafter_config(kind="none"), PROMPTS, SAMPLED)
    assert run(pair, CONFIGS["tree-topk"], PROMPTS, SAMPLED) == plain
    assert run(pair, CONFIGS["lookup"], PROMPTS, SAMPLED) == plain


def test_repetition_penalty_greedy_matches_generate(pair):
    target, _ = pair
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=20)
    for prompt, out in zip(PROMPTS, run(pair, CONFIGS["tree-topk"], PROMPTS, params), strict=True):
        import torch

        ref = target.generate(
            torch.tensor([prompt]), do_sample=False, repetition_penalty=1.3, max_new_tokens=20, min_new_tokens=20
        )[0, len(prompt) :].tolist()
        assert out == ref


def test_stop_token_ids_and_max_tokens(pair):
    target, _ = pair
    ref = reference_greedy(target, PROMPTS[0], 20)
    stop_at = ref[5]
    first = ref.index(stop_at)
    params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(stop_at,))
    target_, draft = pair
    dec = SpeculativeDecoder(
        TargetVerifier(ModelRunner(target_)),
        CONFIGS["chain-rejection"].build(draft, VOCAB),
        DepthConfig(max_depth=4),
    )
    (out,) = dec.generate([PROMPTS[0]], params)
    assert out.output == ref[: first + 1] and out.finish_reason == "stop"
    assert dec.target.runner.rows == [] and dec.drafter.runner.rows == []  # caches freed
    (short,) = dec.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=3))
    assert short.output == ref[:3] and short.finish_reason == "length"


def test_stop_strings_cut_text(pair):
    target, draft = pair
    ref = reference_greedy(target, PROMPTS[1], 20)

    def decode(ids: list[int]) -> str:
        return " ".join(map(str, ids))

    stop = f" {ref[3]} {ref[4]}"
    dec = SpeculativeDecoder(
        TargetVerifier(ModelRunner(target)),
        CONFIGS["lookup"].build(draft, VOCAB),
        DepthConfig(max_depth=4),
        decode=decode,
    )
    (out,) = dec.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=20, stop=(stop,)))
    text = decode(out.output)
    assert out.finish_reason == "stop"
    assert text[: out.text_end] == decode(ref[:3]) or stop not in decode(ref[:3])
    assert stop in text and stop not in text[: out.text_end]
