"""Batch-invariant target forwards (speculative/engine/invariant.py): the attention they run is attention,
and a row's logits are the same bits as a one-token step, in a verify, beside other rows and after any
prefill chunking, in bfloat16 on small random Qwen2 and Llama models (two layers, grouped KV heads)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from actors.config import ModelConfig, TargetConfig, deterministic_on
from speculative.engine.cpu import attention as cpu_attention
from speculative.engine.invariant import BLOCK, InvariantLinear, invariant_attention, make_deterministic
from speculative.engine.runner import ModelRunner, chain_parents

LONG = 2 * BLOCK + 37  # a prompt over two key blocks


def test_invariant_attention_is_attention() -> None:
    """Against SDPA (keys repeated per query head) on grouped heads, a mask, and keys over three blocks."""
    gen = torch.Generator().manual_seed(0)
    b, heads, kv_heads, m, columns, dim = 2, 6, 2, 5, LONG, 32
    query = torch.randn(b, heads, m, dim, generator=gen)
    key, value = torch.randn(2, b, kv_heads, columns, dim, generator=gen)
    allowed = torch.rand(b, 1, m, columns, generator=gen) > 0.3
    allowed[..., 0] = True  # every query sees some key
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)  # [b, 1, m, C]
    g = heads // kv_heads
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(g, 1), value.repeat_interleave(g, 1), attn_mask=mask
    ).transpose(1, 2)  # [b, m, heads, D]
    got = invariant_attention(query, (key, value), mask.repeat(1, 1, g, 1), dim**-0.5)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5)


@pytest.mark.skipif(cpu_attention.library() is None, reason="no AVX2 CPU or no C compiler here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_attention_is_the_torch_formulation_and_each_row_stands_alone(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cpu.attention` (what `invariant_attention` runs here) against the torch blocks within rounding, a
    row's bits the same alone as among 7 others, and masked padding columns adding exact zeros."""
    gen = torch.Generator().manual_seed(1)
    b, heads, kv_heads, m, columns, dim = 2, 12, 2, 7, 300, 128
    query = torch.randn(b, heads, m, dim, generator=gen).to(dtype)
    key, value = torch.randn(2, b, kv_heads, columns, dim, generator=gen).to(dtype)
    mask = torch.zeros(b, 1, heads // kv_heads * m, columns)
    mask[..., -5:] = torch.finfo(torch.float32).min
    got = invariant_attention(query, (key, value), mask.to(dtype), dim**-0.5)  # [b, m, heads, D]
    with monkeypatch.context() as patch:
        patch.setattr(cpu_attention, "library", lambda: None)  # the torch formulation
        torch.testing.assert_close(got, invariant_attention(query, (key, value), mask.to(dtype), dim**-0.5))
    rows = mask.reshape(b, 1, heads // kv_heads, m, columns)
    alone = cpu_attention.attend(query[:, :, 3:4], key, value, rows[:, :, :, 3].to(dtype), dim**-0.5)
    assert alone is not None and torch.equal(alone[:, 0], got[:, 3])
    pad = torch.randn(2, b, kv_heads, 40, dim, generator=gen).to(dtype)
    wider = torch.cat([mask, torch.full((*mask.shape[:-1], 40), torch.finfo(torch.float32).min)], dim=-1)
    padded = cpu_attention.attend(
        query, torch.cat([key, pad[0]], 2), torch.cat([value, pad[1]], 2), wider.to(dtype), dim**-0.5
    )
    assert padded is not None and torch.equal(padded, got)
    # a tree's node: the same visible keys with masked siblings between them (column 100 inserted, masked)
    sibling = torch.full((*mask.shape[:-1], 1), torch.finfo(torch.float32).min)
    between = torch.cat([mask[..., :100], sibling, mask[..., 100:]], dim=-1)
    spread = cpu_attention.attend(
        query,
        torch.cat([key[:, :, :100], pad[0][:, :, :1], key[:, :, 100:]], 2),
        torch.cat([value[:, :, :100], pad[1][:, :, :1], value[:, :, 100:]], 2),
        between.to(dtype),
        dim**-0.5,
    )
    assert spread is not None and torch.equal(spread, got)


# Shapes whose libraries' kernels round a row by the forward's shape on CPUs with native bfloat16 (without
# `make_deterministic` the test below fails on both): grouped KV heads at width 512, and Qwen 1.5B's widths.
SHAPES = {"qwen2": (512, 2048, 4096), "llama": (1536, 8960, 18992)}  # hidden, intermediate, vocabulary


def _deterministic(arch: str) -> torch.nn.Module:
    hidden, intermediate, vocab = SHAPES[arch]
    config = (Qwen2Config if arch == "qwen2" else LlamaConfig)(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval().to(torch.bfloat16)
    why = make_deterministic(model)
    if why is not None:
        pytest.skip(f"this machine's kernels: {why}")
    return model


def _runner(model: torch.nn.Module, prompts: list[list[int]], chunk: int | None = None) -> ModelRunner:
    """A runner holding every prompt but its last token, prefilled in chunks of `chunk` tokens (None: at once)."""
    runner = ModelRunner(model)
    runner.add_rows([f"s{i}" for i in range(len(prompts))])
    longest = max(len(p) for p in prompts)
    step = chunk or longest
    for start in range(0, longest - 1, step):
        runner.extend([p[start : min(start + step, len(p) - 1)] for p in prompts])
    return runner


def _decode(model: torch.nn.Module, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[list]]:
    """One token at a time for every row together: each row's tokens (its last prompt token first) and logits."""
    runner = _runner(model, prompts)
    tokens, logits = [[p[-1]] for p in prompts], [[] for _ in prompts]
    for _ in range(steps):
        out = runner.forward([[t[-1]] for t in tokens], [[-1]] * len(prompts), [[0]] * len(prompts))
        assert out is not None
        runner.commit([[0]] * len(prompts))
        for i, row in enumerate(out):
            logits[i].append(row)
            tokens[i].append(int(row.argmax()))
    return tokens, logits


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", list(SHAPES))
def test_a_row_is_the_same_bits_in_a_step_a_verify_a_batch_and_after_any_chunking(arch: str) -> None:
    model = _deterministic(arch)
    short, long = _prompt(12, 1), _prompt(LONG, 2)
    k = 5
    (short_tokens,), (short_alone,) = _decode(model, [short], k)
    (long_tokens,), (long_alone,) = _decode(model, [long], k)
    _, batched = _decode(model, [short, long], k)  # beside another row (the batch padded to the longer)
    assert all(torch.equal(a, b) for a, b in zip(batched[0], short_alone, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(batched[1], long_alone, strict=True))
    # a verify of the chain the steps took, alone and beside a row decoding one token; prefilled in chunks
    for prompts, chains, chunk in (
        ([long], [long_tokens[:k]], None),
        ([short, long], [short_tokens[:k], [long[-1]]], 7),
    ):
        runner = _runner(model, prompts, chunk)
        out = runner.forward(chains, [chain_parents(len(c)) for c in chains], [list(range(len(c))) for c in chains])
        assert out is not None
        rows = out.split([len(c) for c in chains])
        alone = long_alone if len(prompts) == 1 else short_alone
        assert all(torch.equal(rows[0][i], alone[i]) for i in range(len(chains[0])))
        if len(prompts) == 2:
            assert torch.equal(rows[1][0], long_alone[0])


def test_deterministic_auto_is_on_for_a_bfloat16_cpu_target_of_one_shard() -> None:
    def target(**fields: object) -> TargetConfig:
        model = {"path": "m", "dtype": fields.pop("dtype", "bfloat16"), "weights": fields.pop("weights", "dequantized")}
        return TargetConfig.model_validate({"model": model, **fields})

    assert deterministic_on(target())
    assert not deterministic_on(target(dtype="float32"))
    assert deterministic_on(target(dtype="float32", weights="auto"))  # GGUF weights: invariant kernels beside them
    assert not deterministic_on(target(tp_size=2))
    assert not deterministic_on(target(deterministic="off"))
    assert deterministic_on(target(dtype="float32", deterministic="on"))
    with pytest.raises(ValueError, match="deterministic"):
        target(tp_size=2, deterministic="on")
    assert isinstance(ModelConfig(path="m"), ModelConfig)


@pytest.mark.parametrize("rows", [0, 1, 3, 40])
def test_an_invariant_linear_keeps_the_shape_of_any_input(rows: int) -> None:
    """A one-row step is padded, a call of no rows (every row of the forward still prefilling) passes through."""
    inner = torch.nn.Linear(8, 5)
    layer = InvariantLinear(inner, min_rows=2)
    x = torch.randn(1, rows, 8)
    torch.testing.assert_close(layer(x), inner(x))
    assert layer(x).shape == (1, rows, 5)
