"""The registry's real models in tests: a fetched model's folder, or a skip (a failure in CI, where
`make test` fetches them first)."""

from __future__ import annotations

import ctypes
import gc
import os
from pathlib import Path

import pytest

from modelstore import is_complete, model_dir


def fetched_dir(name: str) -> Path:
    """The HF folder of registry model `name`; skips the test if it is not fetched (fails under CI)."""
    folder = model_dir(name)
    if not is_complete(folder):
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not fetched: `make models` must run before the tests in CI")
        pytest.skip(f"{name} not fetched; run `make models`")
    return folder


def free_memory() -> None:
    """Collect what a test dropped and hand the freed pages back to the system: a real model freed in the test
    process must not stay resident beside the Ray replicas a later test starts (24 GB hold little twice)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
