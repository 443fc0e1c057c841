"""Model loading for workers: weights only (requests arrive as token ids), any HF causal LM."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from actors.config import ModelConfig
from speculative.engine import gguf_weights
from speculative.engine.loading import DTYPES, load_dtype, resolve_quantize, with_kernels
from speculative.rules.grammar import GrammarCompiler

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)
Resolver = Callable[[str], str]  # a model argument -> what from_pretrained takes (modelstore.resolve)


def identity(path: str) -> str:
    return path


def load_lm(config: ModelConfig, resolve: Resolver = identity) -> PreTrainedModel:
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' asked for, but torch sees no CUDA device here")
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)
    quantize = resolve_quantize(config.quantize, config.device)  # auto: by this machine, once
    dtype = DTYPES[load_dtype(config.dtype, quantize, config.device)]  # int8 kernels take float32, int4 bfloat16
    folder = resolve(config.path)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    torch.nn.Module.to(model, torch.device(config.device))  # in place; transformers types .to oddly
    if config.weights != "dequantized":
        _stored(model, folder, config.weights == "stored")
    return with_kernels(model.eval(), quantize, config.cpu_linear)


def _stored(model: PreTrainedModel, folder: str, required: bool) -> None:
    """`model`'s Linear layers on its folder's GGUF tensors (`gguf_weights`), where they can be here; `required`
    (weights: stored) makes a reason they cannot an error, else it is logged and the model stays dense."""
    why = gguf_weights.unavailable(folder, model)
    if why is not None and required:
        raise ValueError(f"weights: 'stored' asked for, but {why}")
    if why is not None:
        logger.info("weights: auto keeps %s dequantized: %s", folder, why)
        return
    path = gguf_weights.gguf_file(folder)
    assert path is not None
    logger.info("%s: %s", path.name, gguf_weights.use_stored(model, path).describe())


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


def load_grammars(path: str, resolve: Resolver = identity) -> GrammarCompiler:
    """The grammar compiler of the model's tokenizer (structured output), loaded at the first grammar:
    a folder without a tokenizer fails the requests that carry one, and only those."""
    return GrammarCompiler.lazy(lambda: AutoTokenizer.from_pretrained(resolve(path)))
