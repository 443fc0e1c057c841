"""Model loading for workers: weights only (requests arrive as token ids), any HF causal LM."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from actors.config import ModelConfig
from speculative.loading import DTYPES

Resolver = Callable[[str], str]  # a model argument -> what from_pretrained takes (deploy.models.resolve)


def identity(path: str) -> str:
    return path


def load_lm(config: ModelConfig, resolve: Resolver = identity) -> PreTrainedModel:
    if config.device != "cpu":
        raise NotImplementedError(
            "device: the core runner (speculative/runner.py) builds its masks and positions on the CPU; "
            "'cuda' needs device support there first"
        )
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)
    model = AutoModelForCausalLM.from_pretrained(
        resolve(config.path), dtype=DTYPES[config.dtype], attn_implementation="sdpa"
    )
    return model.eval()


def vocab_size_of(path: str, resolve: Resolver = identity) -> int:
    """The target's vocabulary from its config, without loading weights."""
    return int(AutoConfig.from_pretrained(resolve(path)).vocab_size)


def load_decoder(path: str, resolve: Resolver = identity) -> Callable[[list[int]], str] | None:
    """token ids -> text with the model's tokenizer (for stop strings); None if the model has none."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve(path))
    except Exception:  # a folder with weights only (tests, token-id clients)
        return None

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids))

    return decode
