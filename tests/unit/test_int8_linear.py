"""`draft_quantize: int8` (speculative/engine/cpu/int8_linear.py): int8 draft layers on our AVX2 kernel and torch's
int8 kernels, within a stated distance of the float layer, and none of torch's deprecated quantization APIs."""

from __future__ import annotations

import ast
import copy
import pickle
import re
import warnings
from pathlib import Path

import pytest
import torch

from speculative.engine.cpu import int8_avx2
from speculative.engine.cpu.int8_linear import ALIGN, FEW_ROWS, Int8Linear, int8_quantized
from speculative.engine.loading import quantized
from tests.tiny_models import tiny_model

ROOT = Path(__file__).resolve().parents[2]
# Each row's distance from the float32 layer, over the row's norm. Few rows: the weights' grid (half a step of
# |w|max / 127 per channel) and bfloat16 activations and outputs (2^-9 relative each), ~0.5 % on Gaussian
# weights. Many rows: the grid and 7-bit activations over the call's range, ~2 %.
FEW_TOLERANCE, MANY_TOLERANCE = 0.01, 0.04


def linear(seed: int = 0, inp: int = 4 * ALIGN, out: int = 48) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(inp, out, bias=True).requires_grad_(False)


def distance(got: torch.Tensor, want: torch.Tensor) -> float:  # [rows, out] each -> the worst row's
    return float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max())


KERNEL = int8_avx2.library() is not None
ON_AVX2 = pytest.mark.skipif(not KERNEL, reason="no AVX2 and FMA CPU here, or the int8 kernel is not built")


def torch_only(layer: Int8Linear) -> Int8Linear:
    """`layer` on torch's kernels alone, as on a CPU without AVX2 or an install without the C kernel."""
    layer.torch_kernels_only()
    return layer


@pytest.mark.parametrize("kernels", ["as built", "torch only"])
@pytest.mark.parametrize("rows", [1, 3, FEW_ROWS, FEW_ROWS + 1, int8_avx2.MAX_ROWS, int8_avx2.MAX_ROWS + 1, 64])
@pytest.mark.parametrize("out", [48, 40])
def test_a_layer_is_the_float_layer_within_tolerance(rows: int, out: int, kernels: str) -> None:
    """Weight-only int8 (our AVX2 kernel up to its MAX_ROWS, else torch's up to FEW_ROWS) within 1 % of the
    float32 layer, more rows (int8 x int8) within 4 %, and not the float layer itself: the int8 weights ran."""
    layer = linear(out=out)
    x = torch.randn(rows, layer.in_features)  # [rows, in]
    wrap = torch_only if kernels == "torch only" else (lambda q: q)
    got, want = wrap(Int8Linear(layer))(x), layer(x)  # [rows, out]
    assert got.dtype == torch.float32
    weight_only = rows <= (int8_avx2.MAX_ROWS if KERNEL and kernels == "as built" else FEW_ROWS)
    assert distance(got, want) <= (FEW_TOLERANCE if weight_only else MANY_TOLERANCE)
    assert not torch.equal(got, want)
    assert torch.equal(wrap(Int8Linear(layer))(x[None, None]), got[None, None])  # leading dimensions kept


@ON_AVX2
@pytest.mark.parametrize("rows", range(1, int8_avx2.MAX_ROWS + 1))
@pytest.mark.parametrize("out", [48, 40, 8, 3])
def test_the_avx2_kernel_is_the_dequantized_weights_product(rows: int, out: int) -> None:
    """Our kernel computes x (codes * scale)^T + b in float32, every row count it takes and outputs that do not
    fill its tiles of 8: within float32 rounding of the same product by torch."""
    layer = Int8Linear(linear(out=out))
    x = torch.randn(rows, layer.in_features)  # [rows, in]
    dequantized = layer.codes().float() * layer.scale.float()[:, None]  # [out, in]
    want = x @ dequantized.T + layer.bias  # [rows, out]
    got = int8_avx2.matmul(layer.tiled, out, x, layer.tiled_scale, layer.tiled_bias)  # type: ignore[arg-type]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_layer_copies_pickles_and_moves() -> None:
    """A quantized draft can be deep-copied and pickled (oneDNN's opaque copy of the weights is packed again),
    and `Module.to` leaves it computing as before, at few rows and many."""
    layer = Int8Linear(linear())
    for rows in (1, 2 * FEW_ROWS):
        x = torch.randn(rows, layer.in_features)  # [rows, in]
        want = layer(x)
        assert torch.equal(copy.deepcopy(layer)(x), want)
        assert torch.equal(pickle.loads(pickle.dumps(layer))(x), want)
        assert torch.equal(layer.to("cpu").to(torch.float32)(x), want)


def test_a_model_is_quantized_where_inputs_fill_the_vectors() -> None:
    """Every Linear whose inputs are a multiple of ALIGN (the kernel's vector) becomes int8, the LM head too;
    others stay float32; a bfloat16 model is refused (the kernels around the layers want float32)."""
    model = int8_quantized(tiny_model("llama"))
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.get_output_embeddings(), Int8Linear)
    assert model(torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, 96)
    odd = int8_quantized(torch.nn.Sequential(torch.nn.Linear(ALIGN + 8, 8), torch.nn.Linear(8, 4)))
    assert all(isinstance(m, torch.nn.Linear) for m in odd)
    with pytest.raises(ValueError, match="float32"):
        int8_quantized(tiny_model("llama").to(torch.bfloat16))


# What torch deprecates: `torch.ao.quantization` (quantize_dynamic, its qconfigs), its modules, and the quantized
# dtypes with the functions and ops that make or take them (torch issue 184982).
DEPRECATED = re.compile(
    r"torch\.ao\.(quantization|nn\.quantized)|quantize_dynamic|quantize_per_(tensor|channel)"
    r"|_make_per_(tensor|channel)_quantized_tensor|torch\.q(u?)int(8|32)|torch\.ops\.quantized\b"
)


def used_names(path: Path) -> set[str]:
    """The dotted names a module imports or reads (`torch.ao.quantization`, `quantize_dynamic`), not its text."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, (ast.Attribute, ast.Name)):
            names.add(ast.unparse(node))
    return names


def test_no_deprecated_quantization_api_is_used() -> None:
    """No module of the package imports or calls a deprecated quantization API, and loading and running an
    int8 draft raises no warning at all with warnings as errors."""
    folders = ("speculative", "actors", "deploy", "modelstore", "bench")
    sources = [path for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))]
    used = [f"{p.relative_to(ROOT)}: {name}" for p in sources for name in used_names(p) if DEPRECATED.search(name)]
    assert used == []
    model = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        draft = quantized(model, "int8")
        for tokens in (1, 2 * FEW_ROWS):  # both kernels
            draft(torch.arange(5, 5 + tokens)[None])
