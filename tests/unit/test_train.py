"""Training heads (speculative/train): the data, the fits, and heads that draft better for it, on a tiny target."""

from __future__ import annotations

import torch

from speculative.decoder import SpeculativeDecoder
from speculative.drafters.config import heads_factory
from speculative.drafters.eagle import load_eagle, save_eagle
from speculative.drafters.heads import TreeDrafter
from speculative.drafters.medusa import load_medusa, save_medusa
from speculative.engine.runner import ModelRunner
from speculative.planning.depth import DepthConfig
from speculative.rules.sampling import SamplingParams
from speculative.target import TargetVerifier
from speculative.train.data import Corpus, observe
from speculative.train.fit import Budget, EagleFit, MedusaFit, eagle_shape, fit_eagle, fit_medusa
from tests.tiny_models import reference_greedy, tiny_model

# The tiny target's own greedy continuations: the text heads learn to predict.
SEEDS = [[5, 6, 7], [11, 12], [20, 21, 22, 23], [7], [30, 31], [40, 41, 42], [50], [60, 61]]


def corpus_of(target) -> Corpus:
    sequences = [s + reference_greedy(target, s, 40) for s in SEEDS]
    return Corpus(observe(target, sequences), len(sequences))


def test_observe_gives_the_targets_features_and_choices():
    target = tiny_model("llama")
    corpus = corpus_of(target)
    sample = corpus.samples[0]
    assert sample.features.shape == (len(sample.tokens), 64) and sample.features.dtype == torch.bfloat16
    # greedy text: the target's choice after each position is the next token
    assert torch.equal(sample.choices[len(SEEDS[0]) - 1 : -1], sample.tokens[len(SEEDS[0]) :])
    assert set(corpus.vocabulary().tolist()) >= set(sample.tokens.tolist())


def _acceptance(target, heads) -> float:
    runner = ModelRunner(target)
    verifier = TargetVerifier(runner, heads=heads(runner))
    decoder = SpeculativeDecoder(verifier, TreeDrafter(verifier.drafted), DepthConfig(max_depth=4, adaptive=False))
    seqs = decoder.generate(SEEDS, SamplingParams(temperature=0.0, max_tokens=32))
    steps = sum(s.stats.steps for s in seqs)
    return (sum(s.stats.accepted for s in seqs) + steps) / steps


def test_fitted_heads_learn_the_targets_text_and_save_in_the_published_layout(tmp_path):
    """A short fit lowers the loss, and the trained heads draft better than untrained ones (steps, not
    minutes, so the test does the same work on any machine)."""
    target = tiny_model("llama")
    corpus = corpus_of(target)
    lm_head = target.get_output_embeddings().weight.detach()
    embed = target.get_input_embeddings().weight.detach()
    medusa, fitted = fit_medusa(corpus, lm_head, Budget(max_steps=300), MedusaFit(heads=2, batch=32, lr=3e-3))
    assert fitted.steps == 300 and _mean(fitted.losses[-30:]) < 0.7 * _mean(fitted.losses[:30])
    untrained, _ = fit_medusa(corpus, lm_head, Budget(max_steps=0), MedusaFit(heads=2))
    assert _acceptance(target, heads_factory(medusa, target)) > _acceptance(target, heads_factory(untrained, target))
    loaded = load_medusa(save_medusa(medusa, tmp_path / "medusa"))
    x = torch.randn(3, 64)
    torch.testing.assert_close(loaded(x), medusa(x))

    shape = eagle_shape(target.config, intermediate=64)
    eagle, fitted = fit_eagle(corpus, embed, lm_head, shape, Budget(max_steps=300), EagleFit(window=32, lr=1e-3))
    assert fitted.steps == 300 and _mean(fitted.losses[-30:]) < 0.7 * _mean(fitted.losses[:30])
    blank, _ = fit_eagle(corpus, embed, lm_head, shape, Budget(max_steps=0))
    assert _acceptance(target, heads_factory(eagle, target)) > _acceptance(target, heads_factory(blank, target))
    again = load_eagle(save_eagle(eagle, tmp_path / "eagle"))
    assert again.shape == eagle.shape


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
