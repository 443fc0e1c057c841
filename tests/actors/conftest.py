"""Tiny random models (fp32, seeded) and reference outputs for the actor tests.

The draft is a noisy copy of the target, so it agrees with the target often (acceptance well
above a random draft's) without being identical. Requests are token ids: no tokenizer.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PreTrainedModel, Qwen2Config

VOCAB = 256

# DeepSpeed's CPU all-reduce op is compiled into this folder (TargetConfig.torch_extensions_dir's
# default): once per machine, ~2 min on 2 cores; every later TP start reuses it.
TORCH_EXTENSIONS = Path("~/.cache/specserve/torch_extensions").expanduser()


@pytest.fixture(scope="session")
def shm_op_built() -> None:
    """Compile DeepSpeed's CPU shared-memory all-reduce before any TP test (at most once per run).

    In a subprocess (importing DeepSpeed here would pin its accelerator choice in the test process);
    torch's extension loader takes a file lock, so shards starting at once never compile twice.
    """
    code = (
        "from deepspeed.accelerator import get_accelerator; "
        "get_accelerator().create_op_builder('ShareMemCommBuilder').load()"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(TORCH_EXTENSIONS), "DS_ACCELERATOR": "cpu"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, timeout=900)


def llama_config(**overrides: object) -> LlamaConfig:
    base: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=2,
        bos_token_id=1,
    )
    base.update(overrides)
    return LlamaConfig(**base)


def save_random(config: object, path: Path, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    return model


def save_noisy_copy(model: PreTrainedModel, path: Path, noise: float, seed: int) -> None:
    """The target's weights plus Gaussian noise of `noise` times each tensor's std."""
    gen = torch.Generator().manual_seed(seed)
    copy = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    state = {}
    for name, t in model.state_dict().items():
        std = float(t.float().std()) if t.numel() > 1 else 0.0
        state[name] = t + noise * std * torch.randn(t.shape, generator=gen)
    copy.load_state_dict(state)
    copy.save_pretrained(path)


@dataclass(frozen=True)
class TinyPair:
    target: str
    draft: str


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> TinyPair:
    root = tmp_path_factory.mktemp("tiny")
    target = save_random(llama_config(), root / "target", seed=0)
    save_noisy_copy(target, root / "draft", noise=0.05, seed=1)
    return TinyPair(str(root / "target"), str(root / "draft"))


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen2 with tied embeddings (as the real Qwen2.5 models)."""
    root = tmp_path_factory.mktemp("qwen")
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        eos_token_id=2,
    )
    save_random(config, root / "m", seed=3)
    return str(root / "m")


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("gpt2")
    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, eos_token_id=2)
    save_random(config, root / "m", seed=4)
    return str(root / "m")


def prompts_and_lengths(n: int, seed: int = 7) -> list[tuple[list[int], int]]:
    """n prompts of different lengths (3..) with different max_tokens (8..)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 3 + (5 * i) % 23
        prompt = torch.randint(3, VOCAB, (length,), generator=gen).tolist()
        out.append((prompt, 8 + (7 * i) % 33))
    return out


def hf_greedy(path: str, prompt: list[int], max_new: int) -> list[int]:
    """The target alone: HF generate(do_sample=False), new tokens only (stops at eos like ours)."""
    model: Any = _cached_model(path)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, attention_mask=torch.ones(1, len(prompt))
        )
    return out[0, len(prompt) :].tolist()


_MODELS: dict[str, PreTrainedModel] = {}


def _cached_model(path: str) -> PreTrainedModel:
    if path not in _MODELS:
        _MODELS[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _MODELS[path]
