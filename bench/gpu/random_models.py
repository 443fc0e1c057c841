"""Models built from a config with random weights of real shapes: benchmarks with no download.

Plain random weights make a model whose greedy choices are near-ties (logits of a random
projection), so forwards of different shapes (a 1-token decode, a k-token verify) flip argmaxes in
bf16 and speculation loses the target's path for numerical, not systemic, reasons. A trained LM is
confident on most tokens; `confident_init` gives a random model that property: the LM head reads
a permutation of the input embeddings, so the current token votes for a fixed successor with a
large margin, and the decoder layers' residual writes are scaled so that their context-dependent
contribution has a set size against that vote (`context`: ~0 = a fixed token chain, larger = more
tokens decided by the context through attention). Costs are unchanged: same shapes, same kernels.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

# Llama-3.1-8B and Llama-3.2-1B shapes; TINY_* are the same architecture at toy size (CPU checks).
SHAPES: dict[str, dict[str, int | bool | float]] = {
    "llama-8b": dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
    ),
    "llama-1b": dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
    ),
    "tiny-target": dict(
        hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=256, vocab_size=1024, tie_word_embeddings=False, rope_theta=500000.0,
    ),
    "tiny-draft": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=1024, tie_word_embeddings=True, rope_theta=500000.0,
    ),
}  # fmt: skip


def build_model(shape: str, device: str, dtype: torch.dtype, seed: int = 0) -> PreTrainedModel:
    """A Llama of the named shape, weights drawn on `device` directly (no host copy of 16 GB)."""
    if shape not in SHAPES:
        raise ValueError(f"shape: expected one of {sorted(SHAPES)}, got {shape!r}")
    config = LlamaConfig(max_position_embeddings=8192, **SHAPES[shape])  # type: ignore[arg-type]
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if next(model.parameters()).device.type != torch.device(device).type:  # a transformers that ignored the context
        model = model.to(device)
    model.generation_config.eos_token_id = None  # random models have no end token: runs are fixed length
    return model.eval()


@torch.no_grad()
def residual_ratio(model: PreTrainedModel, prompt: torch.Tensor) -> float:  # prompt: [1, n] int64
    """||what the layers add to the residual stream|| / ||the token embeddings||, over a prompt."""
    seen: dict[str, torch.Tensor] = {}
    base: Any = model.base_model
    hook = base.norm.register_forward_hook(lambda _m, args, _o: seen.setdefault("h", args[0]))
    try:
        base(input_ids=prompt)
    finally:
        hook.remove()
    embedded = model.get_input_embeddings()(prompt).float()  # [1, n, H]
    return float((seen["h"].float() - embedded).norm() / embedded.norm())


@torch.no_grad()
def confident_init(model: PreTrainedModel, context: float, seed: int = 0) -> PreTrainedModel:
    """Make greedy choices clear (see the module doc); `context` sizes the layers' say in them."""
    if context < 0:
        raise ValueError(f"context: expected >= 0, got {context}")
    config, base = model.config, cast(Any, model.base_model)
    embed: torch.Tensor = cast(Any, model.get_input_embeddings()).weight  # [V, H]
    device = embed.device
    gen = torch.Generator(device=device).manual_seed(seed)
    prompt = torch.randint(0, config.vocab_size, (1, 32), generator=gen, device=device)
    before = residual_ratio(model, prompt)
    # The vote's margin grows as sqrt(H), the best of V random competitors as sqrt(2 ln V).
    wanted = context * math.sqrt(config.hidden_size / (2 * math.log(config.vocab_size)))
    scale = wanted / max(before, 1e-6)
    for layer in base.layers:
        layer.self_attn.o_proj.weight.mul_(scale)
        layer.mlp.down_proj.weight.mul_(scale)
    head: torch.Tensor = cast(Any, model.get_output_embeddings()).weight  # [V, H]
    if head.data_ptr() != embed.data_ptr():  # tied heads (the 1B draft) already vote for the current token
        perm = torch.randperm(config.vocab_size, generator=gen, device=device)
        head.copy_(embed[perm])
    return model
