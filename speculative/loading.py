"""Load a causal LM and its tokenizer from a local HF folder or a hub id."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    eos_ids: frozenset[int]


def eos_ids_of(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None) -> frozenset[int]:
    """End-of-sequence ids from the generation config (may be a list), else the tokenizer."""
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def load_model(path: str, dtype: str = "float32") -> LoadedModel:
    """`path`: a folder with config.json and weights, or a hub id (needs network)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedModel(model.eval(), tokenizer, eos_ids_of(model, tokenizer))
