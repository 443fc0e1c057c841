"""The unit tests run first in `make test`, on every core (pytest-xdist, `--dist loadgroup`): each module's tests
on one worker, so a module's fixtures (pretrained models, servers in threads) are built once, except the
chi-square proofs of the acceptance rules, independent and each minutes of Python, which spread test by test."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent
SPREAD = {"test_acceptance_distribution.py"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent == HERE and item.path.name not in SPREAD:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
