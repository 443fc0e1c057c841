"""A target at its stored precision: GGUF tensors (Q4_K, Q6_K, Q8_0) read by `cpu.kquant`'s kernel.

A tiny Qwen2 model's Linear layers are written into a GGUF file here (through the `gguf` package), the model
is loaded the way a target replica loads it (`load_lm`, weights: stored), and its forward is held against the
same model with the file's weights dequantized by `gguf` itself: within the kernel's stated tolerance (int8
activations), each Linear's rows the same bits at 1, 5 and 16 rows and on 1 or 2 threads.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants
from scipy import stats
from transformers import AutoModelForCausalLM, Qwen2Config

from actors.config import ModelConfig
from actors.cpu_cores import usable_cores
from actors.loading import load_lm
from speculative.decoder import SpeculativeDecoder
from speculative.drafters.config import drafter_config
from speculative.engine import gguf_weights
from speculative.engine.cpu import kquant
from speculative.engine.cpu.int4_linear import grid
from speculative.engine.invariant import make_deterministic
from speculative.engine.runner import ModelRunner
from speculative.planning.depth import DepthConfig
from speculative.rules.sampling import SamplingParams
from speculative.target import TargetVerifier
from tests.tiny_models import noisy_copy
from tests.unit.test_greedy_exact import PROMPTS

pytestmark = pytest.mark.skipif(kquant.library() is None, reason="no AVX2 CPU or no C compiler here")

Q4_K, Q6_K, Q8_0 = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q8_0
Q4_1 = GGMLQuantizationType.Q4_1
# each Linear of the model in one of the three formats (the LM head as GGUF's `output`)
FORMATS = {
    "attn_q": Q4_K,
    "attn_k": Q6_K,
    "attn_v": Q8_0,
    "attn_output": Q4_K,
    "ffn_gate": Q6_K,
    "ffn_up": Q4_K,
    "ffn_down": Q8_0,
}
TOLERANCE = 0.02  # a row's error / its norm: int8 activations per 32 inputs put it near 0.5 %


def _blocks(
    kind: GGMLQuantizationType, out: int, inputs: int, generator: np.random.Generator, scale: float = 1.0
) -> np.ndarray:
    """A valid tensor of `kind` [out, bytes]: random codes and scales of a trained layer's size (times `scale`)."""
    if kind in (Q8_0, Q4_1):
        return quants.quantize(generator.standard_normal((out, inputs)).astype(np.float32) * 0.05 * scale, kind)
    size, block = {Q4_K: (144, 256), Q6_K: (210, 256)}[kind]
    raw = generator.integers(0, 256, (out, inputs // block, size), dtype=np.uint8)
    # weights of about +-0.05: Q4_K's d * sc * q (sc < 64, q < 16) less dmin * m centred; Q6_K's d * sc * (q - 32)
    d = generator.uniform(0.5, 1.5, (out, inputs // block)) * (6e-5 if kind == Q4_K else 1e-5) * scale
    if kind == Q4_K:  # d and dmin lead the block
        raw[..., 0:2] = d.astype(np.float16).view(np.uint8).reshape(out, -1, 2)
        raw[..., 2:4] = (d * 7.5).astype(np.float16).view(np.uint8).reshape(out, -1, 2)
    else:  # d ends it
        raw[..., 208:210] = d.astype(np.float16).view(np.uint8).reshape(out, -1, 2)
    return raw.reshape(out, -1)


def _tiny(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """A tiny Qwen2 folder whose weights are its GGUF file's, dequantized (as `modelstore` converts one), and
    the reference model: the same weights, dense, float32."""
    config = Qwen2Config(
        vocab_size=300,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    generator = np.random.default_rng(0)
    writer = GGUFWriter(str(tmp_path / "tiny.gguf"), "qwen2")
    modules = dict(model.named_modules())
    tensors = [
        (f"blk.{i}.{name}", f"model.layers.{i}.{gguf_weights.LAYER_TENSORS[name]}", kind)
        for i in range(config.num_hidden_layers)
        for name, kind in FORMATS.items()
    ]
    for gguf_name, module, kind in [*tensors, ("output", "lm_head", Q6_K)]:
        layer = modules[module]
        # the head's weights larger: a distribution over tokens far from flat, as a trained model's
        raw = _blocks(kind, layer.out_features, layer.in_features, generator, 40.0 if module == "lm_head" else 1.0)
        writer.add_tensor(f"{gguf_name}.weight", raw, raw_shape=raw.shape, raw_dtype=kind)
        with torch.no_grad():
            layer.weight.copy_(torch.from_numpy(quants.dequantize(raw, kind)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.save_pretrained(tmp_path)
    return tmp_path, model


@pytest.mark.parametrize("kind", [Q4_K, Q6_K, Q8_0, Q4_1])
def test_decoded_codes_stand_for_the_files_weights(kind: GGMLQuantizationType) -> None:
    raw = _blocks(kind, 40, 512, np.random.default_rng(int(kind)))
    codes = kquant.decode(int(kind), raw, 512)
    assert torch.equal(kquant.dequantize(codes), torch.from_numpy(quants.dequantize(raw, kind)))


@pytest.mark.parametrize("kind", [Q4_K, Q6_K, Q8_0, Q4_1])
@pytest.mark.parametrize("order", ["stored", "permuted"])
def test_stored_blocks_are_laid_out_as_their_decoded_codes_are(kind: GGMLQuantizationType, order: str) -> None:
    """`pack_stored` (C, from the file's bytes) writes `pack(decode(...))`'s bytes, byte for byte: 40 outputs (a
    partial last tile, whose missing outputs keep zero scales), in the file's order or rows picked in another."""
    if kquant.library((int(kind),)) is None:
        pytest.skip(f"no kernel here takes {kind.name} (the AVX2 kernel takes Q4_1)")
    raw = _blocks(kind, 40, 512, np.random.default_rng(int(kind)))
    rows = None if order == "stored" else torch.randperm(40, generator=torch.Generator().manual_seed(1))
    picked = raw if rows is None else raw[rows.numpy()]
    expected = kquant.pack(kquant.decode(int(kind), picked, 512)).reshape(-1)
    into = torch.zeros(kquant.packed_bytes(int(kind), 40, 512), dtype=torch.uint8)
    kquant.pack_stored(int(kind), raw, 512, rows, into)
    assert torch.equal(into, expected)


@pytest.mark.skipif(kquant.library((int(Q4_1),)) is None, reason="no kernel here takes Q4_1 (the AVX2 kernel does)")
@pytest.mark.parametrize("source", ["gguf", "grid"])
def test_q4_1_weights_compute_as_their_dequantized_weights_with_the_same_bits_at_any_row_count(source: str) -> None:
    """A draft's 4-bit weight groups (`int4_linear`'s grid, as Q4_1 through `from_grid`) and a GGUF file's Q4_1
    tensor: within the tolerance of x @ W^T over their dequantized weights, each row the same bits at 1, 5 and 16
    rows and on 2 threads; outputs that are no whole tile too."""
    out, inputs = 40, 512
    generator = np.random.default_rng(5)
    if source == "gguf":
        codes = kquant.decode(int(Q4_1), _blocks(Q4_1, out, inputs, generator), inputs)
    else:
        weight = torch.from_numpy(generator.standard_normal((out, inputs)).astype(np.float32)) * 0.05
        codes = kquant.from_grid(*grid(weight))
        assert (kquant.dequantize(codes) - weight).abs().max() < 0.05 * 6 / 15  # within a grid step
    packed = kquant.pack(codes)
    x = torch.randn(16, inputs, generator=torch.Generator().manual_seed(6))  # [16, in]
    full = kquant.matmul(int(Q4_1), packed, out, x)  # [16, out]
    expected = x @ kquant.dequantize(codes).T  # [16, out]
    error = (full - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert error.max() < TOLERANCE, f"rows off by up to {error.max():.4f}"
    for rows in (1, 5):
        assert torch.equal(kquant.matmul(int(Q4_1), packed, out, x[:rows]), full[:rows])
    assert torch.equal(kquant.matmul(int(Q4_1), packed, out, x, threads=2), full)


def test_a_model_loads_on_its_gguf_tensors_and_computes_as_its_dequantized_weights(tmp_path: Path) -> None:
    folder, reference = _tiny(tmp_path)
    model = load_lm(ModelConfig(path=str(folder), dtype="float32", weights="stored"))
    layers = [m for m in model.modules() if isinstance(m, kquant.KQuantLinear)]
    assert len(layers) == 2 * len(FORMATS) + 1  # every Linear, the LM head too
    assert {kquant.NAMES[m.kind] for m in layers} == {"Q4_K", "Q6_K", "Q8_0"}
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, expected = model(ids).logits[0], reference(ids).logits[0]  # [24, vocab]
    error = (got - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert error.max() < TOLERANCE, f"rows off the dequantized model by up to {error.max():.4f}"
    assert not torch.equal(got, expected)  # the kernel ran: int8 activations round


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_outputs_are_the_same_bits_at_any_row_count_and_thread_count(tmp_path: Path, dtype: torch.dtype) -> None:
    folder, reference = _tiny(tmp_path)
    model = load_lm(ModelConfig(path=str(folder), dtype="float32", weights="stored"))
    dense = dict(reference.named_modules())
    layer_weights = {
        id(m): dense[name].weight.detach() for name, m in model.named_modules() if isinstance(m, kquant.KQuantLinear)
    }  # the file's weights, dequantized by gguf
    generator = torch.Generator().manual_seed(2)
    for layer in (m for m in model.modules() if isinstance(m, kquant.KQuantLinear)):
        x = torch.randn(16, layer.in_features, generator=generator).to(dtype)  # [16, in]
        full = kquant.matmul(layer.kind, layer.packed, layer.out_features, x)  # [16, out]
        expected = x.float() @ layer_weights[id(layer)].T  # [16, out]
        error = (full.float() - expected).norm(dim=-1) / expected.norm(dim=-1)
        assert error.max() < TOLERANCE, f"{kquant.NAMES[layer.kind]}: rows off by up to {error.max():.4f}"
        for rows in (1, 5):
            assert torch.equal(kquant.matmul(layer.kind, layer.packed, layer.out_features, x[:rows]), full[:rows])
        assert torch.equal(kquant.matmul(layer.kind, layer.packed, layer.out_features, x, threads=2), full)
        assert layer(x[:0]).shape == (0, layer.out_features)  # a forward whose rows all prefill: no head rows


def test_a_layers_projections_in_one_call_are_the_same_bits_as_a_call_each(tmp_path: Path) -> None:
    """q, k and v (Q4_K, Q6_K, Q8_0 here), and gate and up, through one kernel call (the lean stack's): each the
    bits of its own call, at 1 and 16 rows. With the layer's norm applied by the call, each is its own call on
    torch's normalized rows to the kernel's tolerance, and a row's bits are the same alone and among 16."""
    folder, _ = _tiny(tmp_path)
    model = load_lm(ModelConfig(path=str(folder), dtype="float32", weights="stored"))
    layer = model.model.layers[0]
    generator = torch.Generator().manual_seed(3)
    for norm, parts in [
        (layer.input_layernorm, (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)),
        (layer.post_attention_layernorm, (layer.mlp.gate_proj, layer.mlp.up_proj)),
    ]:
        joint, normed = parts[0].joint(*parts[1:]), parts[0].joint(*parts[1:], norm=kquant.Norm.of(norm))
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(16, parts[0].in_features, generator=generator).to(dtype) * 3  # [16, in]
            for rows in (1, 16):
                for got, part in zip(joint(x[:rows]), parts, strict=True):
                    assert torch.equal(got, part(x[:rows])), f"{kquant.NAMES[part.kind]} joint differs from its call"
            h = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), norm.weight.float(), norm.variance_epsilon)
            for got, alone, part in zip(normed(x), normed(x[:1]), parts, strict=True):
                want = part(h.to(dtype))  # [16, out]
                assert torch.equal(alone, got[:1]), f"{kquant.NAMES[part.kind]}: a normed row's bits depend on M"
                assert (got.float() - want.float()).abs().max() <= 0.03 * want.float().abs().max()
    with pytest.raises(ValueError, match="one input width"):
        layer.mlp.gate_proj.joint(layer.mlp.down_proj)
    with pytest.raises(ValueError, match="a norm of"):
        layer.mlp.down_proj.joint(norm=kquant.Norm.of(layer.input_layernorm))


def test_the_lean_stack_on_gguf_layers_is_the_models_stack_to_the_kernels_rounding(tmp_path: Path) -> None:
    """The lean stack applies each layer's norms inside the GGUF kernel's calls: its logits are the model's own
    stack's (torch's norms, a call a layer) to the kernel's rounding, with the same greedy tokens."""
    folder, _ = _tiny(tmp_path)
    model = load_lm(ModelConfig(path=str(folder), dtype="float32", weights="stored"))
    lean, plain = ModelRunner(model, lean=True), ModelRunner(model)
    prompt = list(range(5, 30))
    logits = []
    for runner in (lean, plain):
        runner.add_rows(["a"])
        logits.append(runner.forward([prompt], [list(range(-1, len(prompt) - 1))], [list(range(len(prompt)))]))
    assert (logits[0] - logits[1]).abs().max() <= 0.05 * logits[1].abs().max()
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


@pytest.mark.skipif(len(usable_cores()) < 2, reason="borrowing needs a second core")
def test_a_borrowing_forward_runs_a_thread_on_the_borrowed_core_with_the_same_bits(tmp_path: Path) -> None:
    """Inside `borrowing((own, other))` the kernel runs 2 threads, the second pinned to `other` (the draft's idle
    core, `TargetSettings.borrow_cores`), and every output is the bits of one thread's."""
    folder, _ = _tiny(tmp_path)
    model = load_lm(ModelConfig(path=str(folder), dtype="float32", weights="stored"))
    own, other = sorted(usable_cores())[:2]
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(4))  # [3, H]
    layer = model.model.layers[0].mlp.gate_proj
    alone = layer(x)

    def pinned_to_other() -> int:  # this process's threads that run on `other` alone
        return sum(os.sched_getaffinity(int(t)) == {other} for t in os.listdir("/proc/self/task"))

    with kquant.borrowing((own, other)) as placed:
        assert placed and kquant._threads == 2
        assert torch.equal(layer(x), alone)
        assert pinned_to_other() >= 1, "the kernel's second thread runs on the borrowed core"
    assert kquant._threads is None, "the thread count is torch's again after the block"
    with kquant.borrowing(()) as placed:
        assert not placed and kquant._threads is None  # nothing to borrow: torch's thread count


def test_a_gguf_file_that_does_not_hold_the_models_weights_is_refused(tmp_path: Path) -> None:
    folder, reference = _tiny(tmp_path)
    with torch.no_grad():
        reference.model.layers[1].mlp.up_proj.weight.mul_(2)  # type: ignore[union-attr, operator]
    reference.save_pretrained(folder)
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight does not hold the model's weight"):
        load_lm(ModelConfig(path=str(folder), dtype="float32", weights="stored"))


def test_stored_weights_without_a_gguf_file_say_why_and_auto_stays_dense(tmp_path: Path) -> None:
    folder, _ = _tiny(tmp_path)
    (folder / "tiny.gguf").unlink()
    with pytest.raises(ValueError, match=r"weights: 'stored' asked for, but .* holds no single GGUF file"):
        load_lm(ModelConfig(path=str(folder), dtype="float32", weights="stored"))
    model = load_lm(ModelConfig(path=str(folder), dtype="float32", weights="auto"))
    assert not any(isinstance(m, kquant.KQuantLinear) for m in model.modules())


def test_a_format_without_a_kernel_stays_dense(tmp_path: Path) -> None:
    folder, _ = _tiny(tmp_path)
    reader_path = folder / "tiny.gguf"
    q5 = GGMLQuantizationType.Q5_0
    model = AutoModelForCausalLM.from_pretrained(folder)
    writer = GGUFWriter(str(reader_path), "qwen2")  # the file again, its blk.0.attn_q in Q5_0
    raw = quants.quantize(model.model.layers[0].self_attn.q_proj.weight.detach().numpy(), q5)
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_shape=raw.shape, raw_dtype=q5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    stored = gguf_weights.use_stored(model, reader_path)
    assert stored.moved == {} and stored.dense == {"Q5_0 (no kernel)": 1}
    assert isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)


@pytest.fixture(scope="module")
def stored_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The tiny model on its GGUF tensors, made batch invariant as a target replica makes it
    (`deterministic: auto`), and a draft: a noisy dense copy of its dequantized weights."""
    folder, reference = _tiny(tmp_path_factory.mktemp("tiny"))
    target = load_lm(ModelConfig(path=str(folder), dtype="float32", weights="stored"))
    assert make_deterministic(target) is None
    return target, noisy_copy(reference, noise=0.05)


@pytest.mark.parametrize("drafter", ["chain", "tree", "lookup"])
def test_speculation_on_stored_weights_gives_plain_decodings_tokens(stored_pair, drafter: str) -> None:
    target, draft = stored_pair
    configs = {
        "chain": drafter_config(kind="model"),
        "tree": drafter_config(kind="model", tree_width=2, tree_nodes=8),
        "lookup": drafter_config(kind="lookup"),
    }
    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    plain = SpeculativeDecoder(TargetVerifier(ModelRunner(target)), None, DepthConfig(max_depth=0))
    expected = [s.output for s in plain.generate(PROMPTS, greedy)]
    proposer = configs[drafter].build(draft, 300)
    spec = SpeculativeDecoder(TargetVerifier(ModelRunner(target, lean=True)), proposer, DepthConfig(max_depth=4))
    decoded = spec.generate(PROMPTS, greedy)
    assert [s.output for s in decoded] == expected
    assert drafter == "lookup" or sum(s.stats.accepted for s in decoded) > 0  # drafts landed: rounds of several rows


def test_sampled_speculation_on_stored_weights_draws_the_targets_distribution(stored_pair) -> None:
    """Sampled chain drafts accepted by rejection on the stored-weights target: the first token over 400 seeds
    follows the target's own top-k distribution at the prompt (chi-square goodness of fit: a gross break
    only). The rules' power comes from their own suite (tests/unit/test_acceptance_distribution.py, 10^5+
    samples per setting): they see only logits, which the stored weights change and nothing else."""
    target, draft = stored_pair
    params = [SamplingParams(temperature=0.8, top_k=6, max_tokens=3, seed=s) for s in range(400)]
    decoded = []
    for start in range(0, len(params), 8):  # a few rows at a time: depths follow load, and 400 rows draft none
        chains = drafter_config(kind="model").build(draft, 300)
        spec_decoder = SpeculativeDecoder(TargetVerifier(ModelRunner(target)), chains, DepthConfig(max_depth=3))
        decoded += spec_decoder.generate([PROMPTS[0]] * 8, params[start : start + 8])
    assert sum(s.stats.accepted for s in decoded) > 100, "drafts landed"
    none = SpeculativeDecoder(TargetVerifier(ModelRunner(target)), None, DepthConfig(max_depth=0))
    plain = [s.output for s in none.generate([PROMPTS[0]] * len(params), params)]
    assert [s.output for s in decoded] != plain, "sampled drafts, accepted by rejection: other draws, same law"
    with torch.no_grad():
        logits = target(torch.tensor([PROMPTS[0]])).logits[0, -1]  # [vocab]
    top = logits.topk(6)
    probs = torch.softmax(top.values / 0.8, dim=-1)  # [6]
    observed = [sum(s.output[0] == int(t) for s in decoded) for t in top.indices]
    assert sum(observed) == len(params), "every first token among the top 6"
    expected = (probs.double() / probs.double().sum() * len(params)).tolist()
    keep = [i for i, e in enumerate(expected) if e >= 5]  # chi-square's bins: the rare tokens pooled
    rare_observed, rare_expected = (
        sum(observed) - sum(observed[i] for i in keep),
        sum(expected) - sum(expected[i] for i in keep),
    )
    f_obs = [observed[i] for i in keep] + ([rare_observed] if rare_expected > 0 else [])
    f_exp = [expected[i] for i in keep] + ([rare_expected] if rare_expected > 0 else [])
    assert stats.chisquare(f_obs, f_exp).pvalue > 0.01
