"""A GGUF file to a plain Hugging Face folder: tokenizer, chat template, stop tokens, fp32 weights."""

from __future__ import annotations

import gc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from modelstore.registry import ModelSpec


def _gguf_chat_template(gguf_path: Path) -> str | None:
    """``tokenizer.chat_template`` straight from the GGUF metadata, if present."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).get_field("tokenizer.chat_template")
    if field is None:
        return None
    value = field.contents()
    return value if isinstance(value, str) and value else None


def _stop_token_ids(spec: ModelSpec, tokenizer: Any) -> list[int]:
    ids = []
    for token in spec.stop_tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id or tokenizer.decode([token_id]) != token:
            raise RuntimeError(f"stop token {token!r} of model {spec.name!r} is not in its vocabulary")
        ids.append(token_id)
    return ids


def _merged_eos(current: int | list[int] | None, extra: Sequence[int]) -> int | list[int] | None:
    merged = [current] if isinstance(current, int) else list(current or [])
    merged += [token_id for token_id in extra if token_id not in merged]
    if not merged:
        return None
    return merged[0] if len(merged) == 1 else merged


def convert(spec: ModelSpec, gguf_path: Path, out: Path) -> None:
    """Dequantize ``gguf_path`` to an fp32 HF folder in ``out`` (tokenizer first, to keep RAM low)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    source = str(gguf_path.parent)  # a local folder: transformers makes no network call for it
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_path.name)
    if getattr(tokenizer, "chat_template", None) is None:
        template = _gguf_chat_template(gguf_path)
        if template is not None:
            tokenizer.chat_template = template
    stop_ids = _stop_token_ids(spec, tokenizer)
    tokenizer.save_pretrained(out)
    del tokenizer
    gc.collect()

    # transformers 5 always builds the model on the meta device first (`low_cpu_mem_usage` is
    # implied, the argument is ignored), so the peak is about the dequantized tensors plus the fp32
    # model. It treats a GGUF model as quantized (the "gguf" quantizer) even when every weight is
    # unpacked, and refuses to save such a model: ask for a fully dense model, check it is one,
    # then drop the quantizer so that it saves as a plain checkpoint.
    model = AutoModelForCausalLM.from_pretrained(
        source,
        gguf_file=gguf_path.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
        local_files_only=True,
    )
    packed = sorted({type(module).__name__ for module in model.modules() if "gguf" in type(module).__name__.lower()})
    if packed:
        raise RuntimeError(f"GGUF conversion left packed modules ({', '.join(packed)}) in {gguf_path.name}")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    generation_config = model.generation_config
    generation_config.eos_token_id = _merged_eos(generation_config.eos_token_id, stop_ids)
    model.save_pretrained(out)
    generation_config.save_pretrained(out)
    del model
    gc.collect()
