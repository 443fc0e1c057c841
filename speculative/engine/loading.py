"""Load a causal LM and its tokenizer from a local HF folder or a hub id."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from speculative.engine.cpu.int4_linear import float32_kernel, int4_quantized
from speculative.engine.cpu.int8_linear import int8_quantized
from speculative.engine.cpu.onednn_linear import native_bf16, packed

if TYPE_CHECKING:
    from transformers import PreTrainedModel  # its module takes ~3 s to import; the auto classes load it when used

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: str = "cpu") -> str:
    """The dtype a model loads in on this machine: `auto` is bfloat16 where `native_bf16`, else float32
    (resolved where the weights load, so each replica of a cluster picks for its own machine)."""
    if dtype == "auto":
        return "bfloat16" if native_bf16(device) else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    return dtype


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
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[resolve_dtype(dtype)], attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedModel(model.eval(), tokenizer, eos_ids_of(model, tokenizer))


def chat_ids(tokenizer: PreTrainedTokenizerBase, user: str) -> list[int]:
    """Token ids of a one-turn chat in the tokenizer's own template (plain text if it has none)."""
    text = user
    if tokenizer.chat_template:
        text = str(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False
            )
        )
    return list(tokenizer(text, add_special_tokens=not tokenizer.chat_template)["input_ids"])


def resolve_quantize(mode: str, device: str = "cpu") -> str:
    """The draft weights' format on this machine: `auto` is int4 on a CPU that computes bfloat16 natively or runs
    the AVX2 GGUF kernel (float32 activations), int8 on other CPUs, none on a GPU (resolved where the weights
    load)."""
    if mode != "auto":
        return mode
    if device != "cpu":
        return "none"
    return "int4" if native_bf16(device) or float32_kernel() else "int8"


def load_dtype(dtype: str, quantize: str, device: str = "cpu") -> str:
    """The dtype the weights load in before `quantized` (`quantize` as `resolve_quantize` gives it): its kernels'
    activations for int8 (float32) and int4 (bfloat16 where the CPU computes it natively or the AVX2 kernel is
    not built, else float32), else `resolve_dtype`."""
    int4 = "bfloat16" if native_bf16(device) or not float32_kernel() else "float32"
    return {"int8": "float32", "int4": int4}.get(quantize, resolve_dtype(dtype, device))


def quantized(model: PreTrainedModel, mode: str) -> PreTrainedModel:
    """`model` with its Linear layers' weights in int8 or int4 (`mode` "int8", "int4", "auto": by
    `resolve_quantize`; "none": unchanged). For draft models: a draft's tokens are only proposals, so a
    quantized draft changes how many are accepted, never the output. The LM head is quantized too.

    int8: `int8_linear` on a float32 model, CPU only: a memory-bound decode step reads a quarter of float32's
    bytes, half of bfloat16's. int4: `int4_linear` on a bfloat16 model, CPU only.
    """
    mode = resolve_quantize(mode, next(model.parameters()).device.type)
    if mode == "none":
        return model
    if mode == "int4":
        return int4_quantized(model)
    if mode == "int8":
        return int8_quantized(model)
    raise ValueError(f"quantize: expected 'none', 'int8', 'int4' or 'auto', got {mode!r}")


def with_kernels(model: PreTrainedModel, quantize: str, cpu_linear: str) -> PreTrainedModel:
    """`model` with its Linear layers on the kernels chosen for it, once at load: `quantized` (a draft's int8 or
    int4), then prepacked through oneDNN where `cpu_linear` is "onednn" (`onednn_linear.packed`)."""
    return packed(quantized(model, quantize), cpu_linear)
