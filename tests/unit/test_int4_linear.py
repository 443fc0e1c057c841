"""`draft_quantize: int4` (speculative/engine/cpu/int4_linear.py): the 4-bit draft layers compute with the
weights they hold."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Iterator

import pytest
import torch

from speculative.engine.cpu import int4_vnni, kquant
from speculative.engine.cpu.int4_linear import (
    GROUP,
    MAX_ROWS,
    Int4Linear,
    Kernel,
    float32_kernel,
    grid,
    int4_quantized,
)
from speculative.engine.loading import load_dtype, native_bf16, quantized, resolve_quantize
from tests.tiny_models import tiny_model


def dequantized(weight: torch.Tensor) -> torch.Tensor:  # [out, in] -> [out, in] float32 on the layer's grid
    """What the layer is meant to hold: per group of GROUP inputs, 16 levels from the group's min to its max."""
    out, inp = weight.shape
    groups = weight.float().reshape(out, inp // GROUP, GROUP)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = (high - low) / 15
    return (torch.round((groups - low) / scale).clamp(0, 15) * scale + low).reshape(out, inp)


def linear(seed: int = 0, inp: int = 4 * GROUP, out: int = 48) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(inp, out, bias=True).to(torch.bfloat16).requires_grad_(False)


VNNI = pytest.mark.skipif(int4_vnni.library() is None, reason="no AVX-512 VNNI CPU here, or the kernel not built")
KERNELS = [pytest.param("vnni", marks=VNNI), "aten"]


@pytest.fixture
def one_thread() -> Iterator[None]:
    """A draft worker's torch threads (`torch_threads: 1`), where `Int4Linear` may pick the VNNI kernel."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("out", [48, 40])
def test_few_rows_compute_with_the_4bit_grid(rows: int, kernel: Kernel, out: int, one_thread: None) -> None:
    """Up to MAX_ROWS rows (a draft step, a small tree) multiply by the 4-bit weights: the result is
    x @ dequantized(W)^T + b up to bfloat16 rounding (and the VNNI kernel's int8 activations), and differs
    from the bfloat16 layer by the grid's error. The VNNI kernel also takes outputs that are no whole tile."""
    if kernel == "aten" and out % 16:
        pytest.skip("torch's int4 layout takes outputs in multiples of 16")
    layer = linear(out=out)
    x = torch.randn(rows, layer.in_features).to(torch.bfloat16)  # [rows, in]
    got = Int4Linear(layer, kernel)(x).float()  # [rows, out]
    want = x.float() @ dequantized(layer.weight).T + layer.bias.float()
    scale = want.abs().max()
    assert (got - want).abs().max() <= 0.01 * scale
    assert (got - layer(x).float()).abs().max() > 0.01 * scale  # the 4-bit path ran, not the bfloat16 one


@pytest.mark.parametrize("kernel", KERNELS)
def test_many_rows_run_on_the_bfloat16_weights(kernel: Kernel, one_thread: None) -> None:
    """A prompt's catch-up (more than MAX_ROWS rows) runs the layer's own bfloat16 weights, bit for bit."""
    layer = linear()
    x = torch.randn(2, MAX_ROWS + 1, layer.in_features).to(torch.bfloat16)  # [2, rows, in]
    assert torch.equal(Int4Linear(layer, kernel)(x), layer(x))


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_layer_copies_and_pickles(kernel: Kernel, one_thread: None) -> None:
    """A quantized draft can be deep-copied and pickled (it holds tensors and a flag, not the loaded library),
    and the copy computes what the original does."""
    layer = Int4Linear(linear(), kernel)
    x = torch.randn(2, layer.in_features).to(torch.bfloat16)  # [2, in]
    assert torch.equal(copy.deepcopy(layer)(x), layer(x))
    assert torch.equal(pickle.loads(pickle.dumps(layer))(x), layer(x))


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_layer_moves_with_module_to(kernel: Kernel, one_thread: None) -> None:
    """`Module.to` on a quantized draft (to the CPU, to its own dtype) leaves it computing as before: the
    layer holds no tensor `to` cannot move (where oneDNN holds the bfloat16 weight, the layer keeps its shape
    alone, not as a buffer)."""
    layer = Int4Linear(linear(), kernel)
    x = torch.randn(MAX_ROWS + 1, layer.in_features).to(torch.bfloat16)  # [rows, in]: the bfloat16 path
    want = layer(x)
    moved = layer.to("cpu").to(torch.bfloat16)
    assert moved.weight.shape == (layer.out_features, layer.in_features)
    assert torch.equal(moved(x), want)


@VNNI
def test_the_vnni_kernel_serves_one_thread_and_torch_more(one_thread: None) -> None:
    """A draft worker (one torch thread) gets the VNNI kernel, one core streaming the weights; a process with
    more threads keeps torch's kernel, which splits a call across them."""
    assert Int4Linear(linear()).vnni
    assert not Int4Linear(linear(), "aten").vnni
    torch.set_num_threads(2)
    assert not Int4Linear(linear()).vnni
    with pytest.raises(ValueError, match="vnni"):
        Int4Linear(linear(), "vnni")


@VNNI
def test_the_vnni_kernel_refuses_rows_it_would_misread(one_thread: None) -> None:
    """float32 rows (a model not in bfloat16) would be read as bfloat16 bytes: refused, as torch's kernel does."""
    layer = Int4Linear(linear(), "vnni")
    with pytest.raises(ValueError, match="bfloat16"):
        layer(torch.randn(1, layer.in_features))


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_q4k_block_is_held_exactly(kernel: Kernel, one_thread: None) -> None:
    """A Q4_K GGUF tensor (the default models' format) stores each 32-weight block as 16 levels above its
    minimum: such weights come back from the layer as they were, up to bfloat16's rounding of the scale."""
    torch.manual_seed(1)
    out, inp = 16, 2 * GROUP
    levels = torch.randint(0, 16, (out, inp // GROUP, GROUP))
    levels[..., 0], levels[..., 1] = 0, 15  # every block spans the full grid, as Q4_K's min/scale fit does
    scale, low = torch.rand(out, inp // GROUP, 1) / 50 + 0.01, torch.randn(out, inp // GROUP, 1) / 10
    weight = (levels * scale + low).reshape(out, inp)
    layer = torch.nn.Linear(inp, out, bias=False)
    layer.weight.data = weight.to(torch.bfloat16)
    eye = torch.eye(inp, dtype=torch.bfloat16)[:MAX_ROWS]  # rows of the identity read the weights' columns back
    got = Int4Linear(layer, kernel)(eye).float().T  # [out, MAX_ROWS]
    assert (got - weight[:, :MAX_ROWS]).abs().max() <= 0.02 * weight.abs().max()


def test_a_model_is_quantized_where_groups_fit() -> None:
    model = int4_quantized(tiny_model("llama").to(torch.bfloat16))
    layers = [m for m in model.modules() if isinstance(m, (Int4Linear, torch.nn.Linear))]
    assert layers and all(isinstance(m, Int4Linear) for m in layers)  # hidden 64, MLP 128: whole groups
    assert model(torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, 96)
    with pytest.raises(ValueError, match=r"int4.*bfloat16"):
        int4_quantized(tiny_model("llama").to(torch.float16))


@pytest.mark.skipif(not float32_kernel(), reason="the AVX2 GGUF kernel (which takes Q4_1) is not built here")
def test_a_float32_model_is_quantized_onto_q4_1_weights_of_the_same_grid() -> None:
    """Without native bfloat16 the draft stays float32 and its layers are the grid's Q4_1 weights on the AVX2 GGUF
    kernel, for every row count: its logits within the int8 activations' reach of the same model computed in
    float32 on the weights the Q4_1 codes stand for, and the same bits for a row alone as beside 11 others."""
    reference = tiny_model("llama")
    for layer in [m for m in reference.modules() if isinstance(m, torch.nn.Linear)]:
        with torch.no_grad():
            layer.weight.copy_(kquant.dequantize(kquant.from_grid(*grid(layer.weight))))
    model = int4_quantized(tiny_model("llama"))
    layers = [m for m in model.modules() if isinstance(m, (kquant.KQuantLinear, torch.nn.Linear))]
    assert layers and all(isinstance(m, kquant.KQuantLinear) and m.kind == kquant.Q4_1 for m in layers)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]])
    with torch.no_grad():
        got, expected = model(ids).logits[0], reference(ids).logits[0]  # [12, vocab]
        alone = model(ids[:, :1]).logits[0]
    assert ((got - expected).norm(dim=-1) / expected.norm(dim=-1)).max() < 0.05
    assert torch.equal(alone[0], got[0])


def test_auto_picks_the_kernel_the_machine_computes_fast() -> None:
    """auto: int4 on a CPU with native bfloat16 (bfloat16 activations) or the AVX2 GGUF kernel (float32), int8 on
    other CPUs, nothing on a GPU; the weights load in the dtype the chosen kernels take."""
    assert resolve_quantize("auto", "cpu") == ("int4" if native_bf16("cpu") or float32_kernel() else "int8")
    assert resolve_quantize("auto", "cuda") == "none"
    assert resolve_quantize("int8", "cpu") == "int8"
    assert load_dtype("float32", "int4") == ("bfloat16" if native_bf16("cpu") or not float32_kernel() else "float32")
    assert load_dtype("bfloat16", "int8") == "float32"
    assert load_dtype("float32", "none") == "float32"
    with pytest.raises(ValueError, match="quantize: expected"):
        quantized(tiny_model("llama"), "int3")
