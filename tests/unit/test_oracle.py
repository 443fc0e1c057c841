"""The benchmark's oracle drafter: the target sees the set per-token acceptance, output stays exact."""

from __future__ import annotations

import pytest

from bench.gpu.oracle import OracleDrafter
from speculative.decoder import SpeculativeDecoder
from speculative.drafters.base import DraftRequest
from speculative.engine.runner import ModelRunner
from speculative.planning.depth import DepthConfig
from speculative.rules.sampling import SamplingParams
from speculative.target import TargetVerifier
from tests.tiny_models import VOCAB, tiny_model

NEW = 64
PROMPTS = [[3 + i, 40 + i, 7, 11 * i % VOCAB] for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def target_and_refs():
    target = tiny_model("llama")
    plain = SpeculativeDecoder(TargetVerifier(ModelRunner(target)), None, DepthConfig())
    refs = [p + s.output for p, s in zip(PROMPTS, plain.generate(PROMPTS, GREEDY), strict=True)]
    return target, refs


def run_oracle(target, refs, acceptance: float, k: int):
    oracle = OracleDrafter(refs, acceptance, VOCAB, seed=3)
    decoder = SpeculativeDecoder(TargetVerifier(ModelRunner(target)), oracle, DepthConfig(adaptive=False, max_depth=k))
    return decoder.generate(PROMPTS, GREEDY), oracle


@pytest.mark.parametrize(("acceptance", "k"), [(0.6, 2), (0.8, 4)])
def test_target_sees_the_set_acceptance_and_output_is_exact(target_and_refs, acceptance, k):
    target, refs = target_and_refs
    seqs, oracle = run_oracle(target, refs, acceptance, k)
    assert [p + s.output for p, s in zip(PROMPTS, seqs, strict=True)] == refs
    accepted = sum(s.stats.accepted for s in seqs)
    assert accepted == oracle.stats.right  # the target kept exactly the oracle's right tokens
    measured = accepted / (accepted + oracle.stats.misses)
    assert measured == pytest.approx(acceptance, abs=0.08)
    assert oracle.stats.off_reference == 0


def test_always_right_commits_k_plus_one(target_and_refs):
    target, refs = target_and_refs
    full, _ = run_oracle(target, refs, 1.0, 3)
    assert sum(s.stats.steps for s in full) == len(PROMPTS) * -(-NEW // 4)  # ceil(NEW / (k+1)) each


def test_never_right_drafts_only_wrong_tokens():
    oracle = OracleDrafter([[1, 2, 3, 4, 5, 6]], 0.0, VOCAB)
    (prop,) = oracle.propose([DraftRequest("a", (1, 2), 4, GREEDY)])
    assert prop.tree.size == 4
    assert all(t != r for t, r in zip(prop.tree.tokens, (3, 4, 5, 6), strict=True))
    assert (oracle.stats.right, oracle.stats.misses) == (0, 1)


def test_sequence_off_its_reference_gets_no_draft():
    oracle = OracleDrafter([[1, 2, 3, 4, 5]], 1.0, VOCAB)
    (on,) = oracle.propose([DraftRequest("a", (1, 2), 3, GREEDY)])
    assert on.tree.tokens == (3, 4, 5)
    (off,) = oracle.propose([DraftRequest("b", (1, 9), 3, GREEDY)])
    assert off.tree.size == 0
    assert oracle.stats.off_reference == 1


def test_bad_acceptance_names_the_field():
    with pytest.raises(ValueError, match="acceptance"):
        OracleDrafter([[1]], 1.5, VOCAB)
