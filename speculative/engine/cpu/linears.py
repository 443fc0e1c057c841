"""A model's Linear layers replaced, once at load, by the layers of the kernels chosen for them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

M = TypeVar("M", bound=torch.nn.Module)


def replaced(model: M, swap: Callable[[torch.nn.Linear], torch.nn.Module | None]) -> M:
    """`model`, in place, with every Linear for which `swap` gives a layer replaced by that layer (None: kept)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and (layer := swap(child)) is not None:
                setattr(parent, name, layer)
    return model
