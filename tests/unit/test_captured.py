"""Captured forwards (`engine.captured`) on tiny Llama and Qwen2 models: every bucket compiles whole
(`fullgraph=True`: a graph break or a host sync inside a forward fails the compile), one graph per bucket,
none recompiled over 200+ served rounds after the start's capture, and greedy output equals HF `generate`
in float32 for chain, tree, lookup, EAGLE and Medusa drafts, mixed batches, sequences joining and leaving,
and rollback (every rejected draft); sampled speculation on it draws what plain sampling draws.

Compiled through dynamo's `aot_eager` backend: the same capture and functionalization inductor starts
from, without generating code (seconds per bucket on a CPU, not minutes)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from scipy import stats

from speculative.decoder import SpeculativeDecoder
from speculative.drafters.config import drafter_config
from speculative.drafters.eagle import EagleTrees
from speculative.drafters.heads import TreeDrafter
from speculative.drafters.medusa import DEFAULT_CHOICES, MedusaTrees
from speculative.engine.captured import Buckets, CapturedRunner, backend_compiler, graphs_on
from speculative.engine.runner import ModelRunner
from speculative.planning.depth import DepthConfig
from speculative.rules.sampling import SamplingParams
from speculative.target import TargetVerifier
from tests.tiny_models import VOCAB, eagle_for, heads_for, joined_mid_stream, noisy_copy, reference_greedy, tiny_model
from tests.unit.test_greedy_exact import PROMPTS

NEW = 24
BUCKETS = Buckets(rows=(1, 2, 4), tokens=(1, 2, 4, 8, 16))
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW)


def graphs_compiled() -> int:
    return int(dynamo_utils.counters["stats"]["unique_graphs"])


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def captured(request):
    """A target, its draft, HF's greedy references, and one captured runner whose buckets were compiled here."""
    target = tiny_model(request.param)
    draft = noisy_copy(target, noise=0.2)
    refs = [reference_greedy(target, p, NEW) for p in PROMPTS]
    before, breaks = graphs_compiled(), sum(dynamo_utils.counters["graph_break"].values())
    runner = CapturedRunner(target, rows=4, columns=256, buckets=BUCKETS, compiler=backend_compiler("aot_eager"))
    lines: list[str] = []
    runner.capture(lines.append)
    assert graphs_compiled() - before == len(BUCKETS.all()), "one graph per bucket"
    assert sum(dynamo_utils.counters["graph_break"].values()) == breaks, "no graph break"
    assert lines[-1] == f"captured forward {len(BUCKETS.all())}/{len(BUCKETS.all())}: 4 rows x 16 tokens"
    return target, draft, refs, runner


def fresh(runner: CapturedRunner) -> CapturedRunner:
    """The captured runner emptied for the next test (its graphs and cache kept)."""
    if runner.rows:
        runner.commit([[] for _ in runner.rows])
        runner.remove_rows(list(runner.rows))
    return runner


def rounds_of(dec: SpeculativeDecoder, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Greedy outputs of `prompts` decoded together, and the rounds (verify forwards) it took."""
    ids = [dec.add(p, GREEDY) for p in prompts]
    rounds = 0
    while dec.has_work:
        dec.step()
        rounds += 1
    by_id = {s.seq_id: s.output for s in dec.finished}
    return [by_id[i] for i in ids], rounds


def decoder(captured, drafter: str) -> SpeculativeDecoder:
    target, draft, _, runner = captured
    verifier = TargetVerifier(fresh(runner))
    if drafter == "eagle":  # a head drafting a tree of 8 nodes, 2 per node, 4 deep
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        verifier = TargetVerifier(runner, heads=EagleTrees(eagle_for(target), embed, head, 2, 4, 8))
        return SpeculativeDecoder(verifier, TreeDrafter(verifier.drafted), DepthConfig(max_depth=5, adaptive=False))
    if drafter == "medusa":
        verifier = TargetVerifier(runner, heads=MedusaTrees(heads_for(target), DEFAULT_CHOICES))
        return SpeculativeDecoder(verifier, TreeDrafter(verifier.drafted), DepthConfig(max_depth=4, adaptive=False))
    configs = {
        "chain": drafter_config(kind="model"),
        "tree": drafter_config(kind="model", tree_width=3, tree_nodes=12),
        "lookup": drafter_config(kind="lookup"),
    }
    return SpeculativeDecoder(verifier, configs[drafter].build(draft, VOCAB), DepthConfig(max_depth=4))


@pytest.mark.parametrize("drafter", ["chain", "tree", "lookup", "eagle", "medusa"])
def test_greedy_on_captured_forwards_equals_generate_without_recompiling(captured, drafter):
    refs = captured[2]
    graphs = graphs_compiled()
    rounds = 0
    for _ in range(3):  # a mixed batch (sequences leave as they finish), then one alone, then joining mid-stream
        outputs, made = rounds_of(decoder(captured, drafter), PROMPTS)
        assert outputs == refs
        assert rounds_of(decoder(captured, drafter), [PROMPTS[2]])[0] == [refs[2]]
        assert joined_mid_stream(decoder(captured, drafter), PROMPTS, GREEDY) == refs
        rounds += made
    assert graphs_compiled() == graphs, "no bucket recompiled after the start's capture"
    assert rounds >= 20


def test_two_hundred_rounds_reuse_the_start_graphs(captured):
    """Rounds of every shape the decoder makes (prefill chunks, verifies of several depths, decodes, rows
    leaving): over 200 of them, not one compile."""
    graphs = graphs_compiled()
    rounds = 0
    while rounds < 200:
        rounds += rounds_of(decoder(captured, "tree"), PROMPTS)[1]
    assert graphs_compiled() == graphs


def test_rollback_leaves_the_cache_as_plain_decoding_would(captured):
    """A tree verified and cut back to its root: the next step's logits are a fresh runner's."""
    target, _, _, runner = captured
    runner = fresh(runner)
    plain = ModelRunner(target)
    for r in (runner, plain):
        r.add_rows(["a"])
        r.extend([PROMPTS[0][:-1]])
    runner.forward([[PROMPTS[0][-1], 3, 4, 5]], [[-1, 0, 0, 1]], [[0, 1, 2, 3]])
    runner.commit([[0]])  # only the root kept: every draft rolled back
    plain.forward([[PROMPTS[0][-1]]], [[-1]])
    plain.commit([[0]])
    got = runner.forward([[9]], [[-1]], [[0]])
    want = plain.forward([[9]], [[-1]], [[0]])
    assert got is not None and want is not None
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    runner.commit([[0]])


def test_sampled_speculation_on_captured_forwards_draws_plain_samplings_distribution(captured):
    """Chain drafts sampled from the draft's q, accepted by rejection on captured forwards: each seed's tokens are
    the op-by-op runner's (the rules and their keyed uniforms are one; the logits agree), so the rules'
    distribution suite (tests/unit/test_acceptance_distribution.py, 10^5+ samples per setting) holds here; and,
    as a check of its own, the first and second tokens' distributions over 240 seeds equal plain sampling's
    (chi-square, two samples: a gross break only)."""
    target, draft, _, runner = captured
    params = [SamplingParams(temperature=0.8, top_k=6, max_tokens=3, seed=s) for s in range(240)]
    prompt = PROMPTS[0]
    spec, op_by_op = [], []
    for start in range(0, len(params), 4):  # the runner's 4 rows at a time (batches alike: depths follow load)
        batch = params[start : start + 4]
        for runner_, out in ((fresh(runner), spec), (ModelRunner(target), op_by_op)):
            chains = drafter_config(kind="model").build(draft, VOCAB)
            dec = SpeculativeDecoder(TargetVerifier(runner_), chains, DepthConfig(max_depth=3))
            out += [s.output for s in dec.generate([prompt] * len(batch), batch)]
    assert spec == op_by_op
    none = SpeculativeDecoder(TargetVerifier(ModelRunner(target)), None, DepthConfig(max_depth=0))
    plain = [s.output for s in none.generate([prompt] * len(params), params)]
    assert spec != plain, "rejection decides by other uniforms than plain sampling's: other draws, same law"
    for at in (0, 1):
        tokens = sorted({s[at] for s in spec} | {p[at] for p in plain})
        table = [[sum(s[at] == t for s in spec) for t in tokens], [sum(p[at] == t for p in plain) for t in tokens]]
        assert stats.chi2_contingency(table).pvalue > 0.01, f"token {at}"


def test_a_cache_past_its_size_is_an_error_not_a_growth(captured):
    _, _, _, runner = captured
    runner = fresh(runner)
    with pytest.raises(ValueError, match="captured KV cache"):
        runner.add_rows(["a", "b", "c", "d", "e"])
    runner.add_rows(["a"])
    with pytest.raises(ValueError, match="captured KV cache"):
        runner.extend([list(range(1, 300))])


def test_graphs_auto_is_off_on_a_cpu_and_on_refuses_an_unknown_stack():
    assert not graphs_on("auto", tiny_model("llama"))
    assert graphs_on("on", tiny_model("qwen2"))
    with pytest.raises(ValueError, match="not a Llama or Qwen2"):
        graphs_on("on", tiny_model("gpt2"))
