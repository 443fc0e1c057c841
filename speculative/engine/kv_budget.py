"""How many tokens of KV cache a replica can hold: configured, or measured from free memory at start.

A token's KV costs, in every layer, one key and one value vector per KV head:

    bytes per token = layers x kv_heads x head_dim x 2 (key, value) x dtype bytes

(kv_heads per tensor-parallel shard: a shard holds its share of the heads). Qwen2.5-1.5B in bf16:
28 x 2 x 128 x 2 x 2 = 28,672 bytes, so 8 GiB of free memory holds 299,593 tokens. Measured, the
budget is `fraction` of the memory free once the weights are loaded, divided by the bytes per token.
Free memory is the GPU's free memory; on a CPU, the host's available memory or, where the process's
cgroup has a memory limit (a container), what is left under that limit, whichever is less: a container
limited to 16 GiB on a 256 GiB host has at most 16 GiB less its usage. The runners' buffers draw on one
pool per process of the budget's bytes plus a quarter for padding (`kv_pool`); the rest of the free
memory is headroom for activations.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PretrainedConfig

CGROUP_ROOT = Path("/sys/fs/cgroup")  # where the cgroup file systems are mounted
OWN_CGROUP = Path("/proc/self/cgroup")  # this process's cgroup under each hierarchy
NO_LIMIT = 1 << 62  # cgroup v1 writes "no limit" as the largest page-aligned counter, 9223372036854771712


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


def free_memory_bytes(device: torch.device, cgroups: Path = CGROUP_ROOT, own: Path = OWN_CGROUP) -> int:
    """Memory free now on `device`: the GPU's free memory, or the host's MemAvailable bounded by what this
    process's cgroup may still take (`cgroup_room`)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    available = host_available_bytes()
    room = cgroup_room(cgroups, own)
    return available if room is None else min(available, room)


def host_available_bytes() -> int:
    """The host's MemAvailable (what every process of the machine may still take, unbounded by cgroups)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # in kB
    raise RuntimeError("no MemAvailable in /proc/meminfo: configure kv_budget_tokens")


def cgroup_room(cgroups: Path = CGROUP_ROOT, own: Path = OWN_CGROUP) -> int | None:
    """Bytes this process's cgroup may still take before its memory limit: the least, over its cgroup and those
    above it, of limit - (usage - inactive page cache, which the kernel reclaims first); None where none has a
    limit (or there is no cgroup file system).

    cgroup v2 (`cgroups`/cgroup.controllers exists): memory.max ("max": no limit), memory.current, memory.stat's
    inactive_file, under the "0::" line of `own`. v1: the memory controller's memory.limit_in_bytes (NO_LIMIT or
    more: no limit), memory.usage_in_bytes, memory.stat's total_inactive_file, under the "memory" line. A
    container's own cgroup is often mounted as the root: paths of `own` missing here are skipped.
    """
    if (cgroups / "cgroup.controllers").exists():
        names, base = ("memory.max", "memory.current", "inactive_file"), cgroups
    else:
        names, base = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"), cgroups / "memory"
    rooms = [r for d in _own_dirs(base, own, v2=base == cgroups) if (r := _room(d, *names)) is not None]
    return min(rooms, default=None)


def _own_dirs(base: Path, own: Path, v2: bool) -> list[Path]:
    """This process's cgroup directory under `base` and every one above it, up to `base`, that exists."""
    path = ""
    if own.exists():
        for line in own.read_text().splitlines():
            _, controllers, where = line.split(":", 2)
            if (v2 and controllers == "") or (not v2 and "memory" in controllers.split(",")):
                path = where
    here = base / path.strip("/")
    return [d for d in (here, *here.parents) if d.is_relative_to(base) and d.exists()]


def _room(folder: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    """limit - (usage - inactive page cache) of one cgroup directory; None without a limit."""
    limit_path, usage_path = folder / limit_file, folder / usage_file
    if not limit_path.exists() or not usage_path.exists():
        return None
    limit = limit_path.read_text().strip()
    if limit == "max" or int(limit) >= NO_LIMIT:
        return None
    usage = int(usage_path.read_text())
    stat = folder / "memory.stat"
    inactive = 0
    if stat.exists():
        for line in stat.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == inactive_key:
                inactive = int(value)
    return max(int(limit) - (usage - inactive), 0)


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
