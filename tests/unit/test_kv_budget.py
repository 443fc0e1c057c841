"""The KV budget: bytes per token from a model's config, the budget measured from free memory, the ledger."""

from __future__ import annotations

import time

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
