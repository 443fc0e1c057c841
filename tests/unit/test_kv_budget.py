"""The KV budget: bytes per token from a model's config, the budget measured from free memory (the host's or its
cgroup's), the ledger."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, Qwen2Config

from actors.admission import ContextWindow, KvLedger
from speculative.engine import kv_budget
from speculative.engine.kv_budget import kv_budget_tokens, kv_bytes_per_token, max_model_len

# Qwen2.5-1.5B's shape (its config.json): 28 layers, 12 query heads over 1,536 dims, 2 KV heads.
QWEN_15B = Qwen2Config(num_hidden_layers=28, hidden_size=1536, num_attention_heads=12, num_key_value_heads=2)


def test_bytes_per_token_is_layers_kv_heads_head_dim_key_and_value_dtype() -> None:
    assert kv_bytes_per_token(QWEN_15B, torch.bfloat16) == 28 * 2 * 128 * 2 * 2 == 28_672
    assert kv_bytes_per_token(QWEN_15B, torch.float32, tp_size=2) == 28 * 1 * 128 * 2 * 4
    gpt2 = GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=256)  # no KV-head grouping: every head
    assert kv_bytes_per_token(gpt2, torch.float32) == 2 * 4 * 16 * 2 * 4
    assert max_model_len(gpt2) == 256


def test_a_measured_budget_is_the_fraction_of_free_memory_over_bytes_per_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_budget, "free_memory_bytes", lambda device: 8 << 30)
    cpu = torch.device("cpu")
    assert kv_budget_tokens(None, 1.0, QWEN_15B, torch.bfloat16, cpu) == 299_593  # the module docstring's example
    assert kv_budget_tokens(None, 0.5, QWEN_15B, torch.bfloat16, cpu) == 149_796
    assert kv_budget_tokens(1000, 0.5, QWEN_15B, torch.bfloat16, cpu) == 1000  # configured: not measured


def test_free_memory_of_this_host_is_positive() -> None:
    assert kv_budget.free_memory_bytes(torch.device("cpu")) > 0


def cgroup_tree(root: Path, membership: str, files: dict[str, str]) -> Path:
    """A fake cgroup file system under `root` (file path -> content) and a /proc/self/cgroup naming `membership`."""
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(content)
    own = root.parent / f"{root.name}-own"
    own.write_text(membership)
    return own


MIB = 1 << 20
V2 = {"cgroup.controllers": "cpu memory"}  # what marks a cgroup v2 (unified) mount
V1_NONE = "9223372036854771712"  # cgroup v1's "no limit"

# name -> (/proc/self/cgroup, files, room in MiB or None: no limit)
CGROUPS: dict[str, tuple[str, dict[str, str], int | None]] = {
    # a container: its own cgroup is the root; limit - (usage - inactive page cache) = 1,024 - (400 - 100)
    "v2-container": (
        "0::/\n",
        V2
        | {
            "memory.max": f"{1024 * MIB}",
            "memory.current": f"{400 * MIB}",
            "memory.stat": f"inactive_file {100 * MIB}",
        },
        724,
    ),
    # a host: the process's cgroup has no limit of its own ("max"), the slice above it has: 2,048 - 1,536
    "v2-slice": (
        "0::/serving.slice/shard.scope\n",
        V2
        | {
            "serving.slice/memory.max": f"{2048 * MIB}",
            "serving.slice/memory.current": f"{1536 * MIB}",
            "serving.slice/shard.scope/memory.max": "max",
            "serving.slice/shard.scope/memory.current": f"{512 * MIB}",
        },
        512,
    ),
    "v2-max": ("0::/a\n", V2 | {"a/memory.max": "max", "a/memory.current": f"{MIB}"}, None),
    # v1 under the "memory" line; its path is missing from the mount (a container's own cgroup is the root)
    "v1-container": (
        "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n",
        {
            "memory/memory.limit_in_bytes": f"{3072 * MIB}",
            "memory/memory.usage_in_bytes": f"{1024 * MIB}",
            "memory/memory.stat": f"cache {600 * MIB}\ntotal_inactive_file {24 * MIB}\n",
        },
        2072,
    ),
    "v1-no-limit": (
        "4:memory:/process_api/xyz\n",
        {
            "memory/process_api/xyz/memory.limit_in_bytes": V1_NONE,
            "memory/process_api/xyz/memory.usage_in_bytes": f"{5 * MIB}",
            "memory/memory.limit_in_bytes": V1_NONE,
            "memory/memory.usage_in_bytes": f"{9000 * MIB}",
        },
        None,
    ),
    "no-cgroup-fs": ("0::/\n", {}, None),
}


@pytest.mark.parametrize("case", CGROUPS)
def test_cgroup_room_is_the_least_limit_less_usage_over_the_process_s_cgroups(tmp_path: Path, case: str) -> None:
    membership, files, room = CGROUPS[case]
    own = cgroup_tree(tmp_path / "cg", membership, files)
    assert kv_budget.cgroup_room(tmp_path / "cg", own) == (None if room is None else room * MIB)


def test_free_memory_on_a_cpu_is_the_host_s_or_the_cgroup_s_whichever_is_less(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = cgroup_tree(
        tmp_path / "cg",
        "0::/\n",
        V2 | {"memory.max": f"{1024 * MIB}", "memory.current": f"{256 * MIB}"},
    )
    cpu = torch.device("cpu")
    monkeypatch.setattr(kv_budget, "host_available_bytes", lambda: 16_384 * MIB)
    assert kv_budget.free_memory_bytes(cpu, tmp_path / "cg", own) == 768 * MIB  # the container's, not the host's
    monkeypatch.setattr(kv_budget, "host_available_bytes", lambda: 512 * MIB)
    assert kv_budget.free_memory_bytes(cpu, tmp_path / "cg", own) == 512 * MIB  # the host is fuller


def test_the_ledger_grants_what_fits_and_returns_it_on_release() -> None:
    ledger = KvLedger(budget=1024, idle_s=60.0, replica="r")
    assert ledger.reserve("a", 500).granted and ledger.reserve("b", 200).granted  # the docstring's example
    refused = ledger.reserve("c", 400)
    assert (refused.granted, refused.held, refused.budget) == (False, 700, 1024)
    assert ledger.reserve("a", 500).granted and ledger.held == 700  # asking again holds it once
    ledger.release(["a", "unknown"])
    assert ledger.reserve("c", 400).granted and (ledger.held, len(ledger)) == (600, 2)


def test_the_ledger_takes_over_running_sequences_and_forgets_idle_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = KvLedger(budget=100, idle_s=10.0, replica="r")
    ledger.running({"moved": 80, "old": 0})  # granted by another replica: counted; no reservation: ignored
    assert (ledger.held, len(ledger)) == (80, 1)
    assert not ledger.reserve("new", 30).granted
    now = time.monotonic()
    monkeypatch.setattr("actors.admission.time.monotonic", lambda: now + 11.0)  # its router went silent
    assert ledger.reserve("new", 30).granted and ledger.held == 30


def test_the_smallest_window_names_its_limit() -> None:
    model, budget = ContextWindow(32_768, "the model"), ContextWindow(4_096, "target_pool.kv_budget_tokens")
    assert ContextWindow.smallest(model, None, budget) == budget
