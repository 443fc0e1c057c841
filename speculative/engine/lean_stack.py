"""The transformer stack of a Llama-family model (Llama, Qwen2) as plain tensor ops, for the draft model.

A draft forward of a few tokens on a CPU core is short enough that the framework around its tensor ops
shows: `transformers`' stack spends a few milliseconds per forward in module calls, keyword plumbing and
norms written as eight ops. This stack runs the same weights through the same operations in the same
order (the model's own Linear layers, rotary embedding and activation; `packing.packed_attention` over the
runner's `SlotCache`), with a fused RMS norm, so its hidden states equal the model's bit for bit; it only
calls less. Where a layer's projections hold GGUF weights (`kquant.KQuantLinear`: a target at its stored
precision, a draft on Q4_1 groups) their kernel also applies the norm before them as it reads its input (one
call instead of a norm's ops and a call): the kernel's own rounding, not the model's bits, and like the kernel
each row's alone, so the stack stays batch invariant. Rotary embeddings of float32 rows on a CPU are one C call
a tensor (`cpu.attention.rotate`, torch's bits). Architectures or configurations it does not know (sliding
windows, other norms) return None from `lean_stack`, and the runner keeps the model's own stack.

Per layer, for T packed tokens of hidden size H:

    h = norm(x);  q, k, v = proj(h);  q, k = rotary(q, k);  cache <- k, v
    x = x + o(attention(q, cache));  x = x + down(act(gate(norm(x))) * up(norm(x)))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from speculative.engine.cpu import attention as cpu_attention
from speculative.engine.cpu.kquant import KQuantLinear, Norm
from speculative.engine.kv_cache import SlotCache
from speculative.engine.packing import packed_attention

KNOWN = ("LlamaModel", "Qwen2Model")  # base models whose decoder layers are the loop below


def _rms_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:  # [T, H] -> [T, H]
    """`LlamaRMSNorm` / `Qwen2RMSNorm`: normalized in float32, back to x's dtype, then scaled."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype) * norm.weight


def _rotated(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:  # [T, heads * D]
    """Rotary embedding as `apply_rotary_pos_emb` computes it (halves rotated, not interleaved pairs) of a
    projection's output y (a fresh tensor: rotated in place by one C call where float32 on the CPU, the same
    bits); cos and sin [T, D]."""
    if not torch.compiler.is_compiling() and cpu_attention.rotate(y, cos, sin, dim):  # (a captured step: torch's)
        return y
    x = y.view(y.shape[0], -1, dim)  # [T, heads, D]
    half = dim // 2
    c, s = cos[:, None], sin[:, None]  # [T, 1, D]: broadcast over heads
    return (x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s).view(y.shape)


Projections = Callable[[torch.Tensor], list[torch.Tensor]]  # [T, in] -> each Linear's [T, out]


def projections(norm: Any, *linears: Any) -> Projections:
    """The Linear layers' outputs of one input normalized by `norm`: one kernel call where all hold GGUF weights
    (the kernel normalizes the input in float32 as it reads it and quantizes it once: `KQuantLinear.joint`), else
    the norm, then a call each."""
    if all(isinstance(m, KQuantLinear) for m in linears):
        return linears[0].joint(*linears[1:], norm=Norm.of(norm))
    return lambda x: _each(linears, _rms_norm(x, norm))


def _each(linears: tuple[Any, ...], h: torch.Tensor) -> list[torch.Tensor]:
    return [m(h) for m in linears]


def layer_projections(base: Any) -> list[tuple[Projections, Projections]]:
    """Per layer, its (q, k, v) projections of the normalized input and its (gate, up) ones of the normalized
    attention output."""
    return [
        (
            projections(layer.input_layernorm, layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
            projections(layer.post_attention_layernorm, layer.mlp.gate_proj, layer.mlp.up_proj),
        )
        for layer in base.layers
    ]


# layer i's attention: rotated queries [1, heads, T, D], rotated keys and values [1, kv_heads, T, D] -> [T, heads * D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def run_layers(
    base: Any,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    attend: Attend,
    projected: list[tuple[Projections, Projections]] | None = None,
) -> torch.Tensor:
    """The stack over packed tokens [T] at position ids [T] -> last hidden states [T, H], after the final norm;
    `attend` stores each layer's keys and values and attends (the runner's packed cache, or a fixed one);
    `projected`: `layer_projections(base)`, made once (None: made here)."""
    projected = projected if projected is not None else layer_projections(base)
    x = base.embed_tokens(tokens)  # [T, H]
    t = x.shape[0]
    cos, sin = (c[0].contiguous() for c in base.rotary_emb(x[None], positions[None]))  # [T, D] each
    for i, layer in enumerate(base.layers):
        attn, mlp = layer.self_attn, layer.mlp
        d = attn.head_dim
        qkv, gate_up = projected[i]
        q, k, v = qkv(x)  # [T, heads * D], [T, kv_heads * D] x 2
        q, k, v = (y.view(1, t, -1, d).transpose(1, 2) for y in (_rotated(q, cos, sin, d), _rotated(k, cos, sin, d), v))
        x = x + attn.o_proj(attend(i, q, k, v))  # q: [1, heads, T, D]
        gate, up = gate_up(x)
        x = x + mlp.down_proj(mlp.act_fn(gate) * up)
    return _rms_norm(x, base.norm)


@dataclass(frozen=True)
class LeanStack:
    """`base(input_ids, position_ids, attention_mask, cache)` of a known base model, fewer calls."""

    base: Any  # the model's `base_model` (its submodules are read by name, as `lean_stack` checked them)
    projected: list[tuple[Projections, Projections]]  # `layer_projections(base)`

    def __call__(
        self,
        tokens: torch.Tensor,  # [T] the packed new tokens
        positions: torch.Tensor,  # [T] their position ids
        mask: torch.Tensor,  # the runner's packed mask (`Packing.mask`)
        cache: SlotCache,
    ) -> torch.Tensor:  # [T, H] the last hidden states, after the final norm
        layers = self.base.layers

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            attn = layers[i].self_attn
            keys, values = cache.update(k, v, i)  # [B, kv_heads, width, D] each
            o, _ = packed_attention(attn, q, keys, values, mask, dropout=0.0, scaling=attn.scaling)
            return o.reshape(q.shape[2], -1)

        return run_layers(self.base, tokens, positions, attend, self.projected)


def lean_stack(base: torch.nn.Module) -> LeanStack | None:
    """A `LeanStack` over `base` (a causal LM's `base_model`), or None where its layers are not the known
    loop: another architecture, sliding-window layers, or parts named or shaped otherwise."""
    stack: Any = base
    if type(stack).__name__ not in KNOWN:
        return None
    config: Any = stack.config
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return None
    for layer in stack.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if getattr(attn, "sliding_window", None) is not None:
            return None
        parts = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not all(hasattr(n, "variance_epsilon") for n in norms) or any(p is None for p in parts):
            return None
    return LeanStack(stack, layer_projections(stack)) if hasattr(stack.norm, "variance_epsilon") else None
