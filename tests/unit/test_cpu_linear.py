"""`cpu_linear: onednn`: float32 and bfloat16 Linear layers through oneDNN with prepacked weights.

The packed model computes what the unpacked one does up to float32 rounding (bfloat16: the same bits), and
speculation over it stays exact: greedy output through the decoder, drafting and verifying on packed
models, is the packed target's own `generate(do_sample=False)`.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from actors.config import ModelConfig, TargetConfig
from speculative.decoder import SpeculativeDecoder
from speculative.drafters.config import drafter_config
from speculative.engine.cpu.onednn_linear import PackedLinear, packed
from speculative.engine.loading import native_bf16, quantized
from speculative.engine.runner import ModelRunner
from speculative.planning.depth import DepthConfig
from speculative.rules.sampling import SamplingParams
from speculative.target import TargetVerifier
from tests.tiny_models import VOCAB, full_logits, noisy_copy, reference_greedy, tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [11, 12], [7]]
NEW = 16


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (9, 48), (2, 5, 48)])
def test_packed_linear_computes_the_linear(shape: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80, bias=bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        want, got = linear(x), PackedLinear(linear)(x)
    assert got.shape == want.shape == (*shape[:-1], 80)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


BF16 = pytest.mark.skipif(not native_bf16("cpu"), reason="oneDNN has no native bfloat16 kernels on this CPU")


@BF16
@pytest.mark.parametrize("rows", [1, 9, 40, 128])
def test_packed_bfloat16_computes_torchs_bits(rows: int) -> None:
    """torch's bfloat16 Linear runs the same oneDNN kernel, reordering the weight on every call: packed once,
    the layer gives the same bits at every row count (so verification matches plain decoding as before)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 320, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 256).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(PackedLinear(linear)(x), linear(x))


def test_a_packed_layer_copies_and_pickles() -> None:
    """A packed layer deep-copies and pickles (oneDNN's blocked weight is opaque: it travels unpacked)."""
    layer = PackedLinear(torch.nn.Linear(48, 80))
    x = torch.randn(3, 48)
    with torch.inference_mode():
        assert torch.equal(copy.deepcopy(layer)(x), layer(x))
        assert torch.equal(pickle.loads(pickle.dumps(layer))(x), layer(x))


def test_float32_and_native_bfloat16_cpu_linears_are_packed() -> None:
    model = packed(tiny_model("llama"), "onednn")
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert any(isinstance(m, PackedLinear) for m in model.modules())
    half = packed(tiny_model("llama").to(torch.bfloat16), "onednn")  # where oneDNN computes bf16 natively
    assert any(isinstance(m, PackedLinear) for m in half.modules()) == native_bf16("cpu")
    fp16 = packed(tiny_model("llama").to(torch.float16), "onednn")  # torch's kernels
    assert not any(isinstance(m, PackedLinear) for m in fp16.modules())
    int8 = packed(quantized(tiny_model("llama"), "int8"), "onednn")  # nothing left to pack
    assert not any(isinstance(m, PackedLinear) for m in int8.modules())
    assert packed(model, "torch") is model
    with pytest.raises(ValueError, match="cpu_linear: expected 'torch' or 'onednn'"):
        packed(tiny_model("llama"), "mkl")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_model_matches_the_unpacked_and_speculation_stays_exact(arch: str) -> None:
    target = tiny_model(arch)
    draft = noisy_copy(target, noise=0.2)
    packed_target = packed(copy.deepcopy(target), "onednn")
    packed_draft = packed(draft, "onednn")
    with torch.inference_mode():
        for prompt in PROMPTS:
            torch.testing.assert_close(
                full_logits(packed_target, prompt), full_logits(target, prompt), rtol=1e-4, atol=1e-4
            )
    refs = [reference_greedy(packed_target, p, NEW) for p in PROMPTS]
    decoder = SpeculativeDecoder(
        TargetVerifier(ModelRunner(packed_target)),
        drafter_config(kind="model").build(packed_draft, VOCAB),
        DepthConfig(max_depth=4, adaptive=False),
    )
    outs = decoder.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW))
    assert [o.output for o in outs] == refs
    assert sum(o.stats.accepted for o in outs) > 0


def test_onednn_is_for_one_cpu_shard() -> None:
    with pytest.raises(ValueError, match="cpu_linear: 'onednn' is for device: cpu"):
        ModelConfig(path="t", device="cuda", cpu_linear="onednn")
    with pytest.raises(ValueError, match="cpu_linear: 'onednn' needs tp_size 1"):
        TargetConfig(model=ModelConfig(path="t", cpu_linear="onednn"), tp_size=2)
