"""How many tokens of KV cache a replica can hold: configured, or measured from free memory at start.

A token's KV costs, in every layer, one key and one value vector per KV head:

    bytes per token = layers x kv_heads x head_dim x 2 (key, value) x dtype bytes

(kv_heads per tensor-parallel shard: a shard holds its share of the heads). Qwen2.5-1.5B in bf16:
28 x 2 x 128 x 2 x 2 = 28,672 bytes, so 8 GiB of free memory holds 299,593 tokens. Measured, the
budget is `fraction` of the memory free once the weights are loaded (the GPU's free memory, or the
host's available memory on a CPU), divided by the bytes per token; the rest is headroom for
activations and for the runner's padding of rows to a group's longest.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PretrainedConfig


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of KV cache one token takes in one shard of a model with this config."""
    layers = int(config.num_hidden_layers)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    shard_heads = -(-kv_heads // tp_size)  # a shard holds ceil(kv_heads / tp) heads
    return layers * shard_heads * head_dim * 2 * dtype.itemsize


def max_model_len(config: PretrainedConfig) -> int:
    """The longest sequence the model's positions cover (max_position_embeddings; GPT-2's n_positions)."""
    return int(config.max_position_embeddings)


def free_memory_bytes(device: torch.device) -> int:
    """Memory free now on `device`: the GPU's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # in kB
    raise RuntimeError("no MemAvailable in /proc/meminfo: configure kv_budget_tokens")


def kv_budget_tokens(
    configured: int | None,
    fraction: float,
    config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    tp_size: int = 1,
) -> int:
    """`configured`, or `fraction` of the memory free on `device` over one shard's KV bytes per token.

    Measured on each shard after its weights are loaded; a replica's budget is its smallest shard's.
    """
    if configured is not None:
        return configured
    return int(free_memory_bytes(device) * fraction) // kv_bytes_per_token(config, dtype, tp_size)
