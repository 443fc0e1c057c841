"""The registry's real models in tests: a fetched model's folder, or a skip (a failure in CI, where
`make test` fetches them first)."""

from __future__ import annotations

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
