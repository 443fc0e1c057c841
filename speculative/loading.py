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


def truncated_copy(model: PreTrainedModel, n_layers: int) -> PreTrainedModel:
    """A self-draft: the model's own first `n_layers` decoder layers, sharing its weights.

    Same tokenizer by construction; useful where no smaller partner model exists (LayerSkip-style
    drafting without the early-exit training, so acceptance is modest).
    """
    import copy

    layers = getattr(model.base_model, "layers", None) or getattr(model.base_model, "h", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find its decoder layers to truncate")
    if not 1 <= n_layers <= len(layers):
        raise ValueError(f"n_layers: expected 1..{len(layers)}, got {n_layers}")
    draft = copy.copy(model)  # shallow: parameters are shared, not copied
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = n_layers
    object.__setattr__(draft, "config", config)
    base = copy.copy(model.base_model)
    base._modules = dict(base._modules)  # a shallow copy shares this dict with the original
    base_name = model.base_model_prefix
    kept = torch.nn.ModuleList(list(layers)[:n_layers])
    if hasattr(base, "layers"):
        base.layers = kept
    else:
        base.h = kept
    object.__setattr__(base, "config", config)
    draft._modules = dict(model._modules)
    draft._modules[base_name] = base
    return draft
