"""Counting the reads that make the host wait for the device: `.item()`, `.tolist()`, `.cpu()`,
`.numpy()` and the ops whose output size depends on the data (nonzero, masked_select, unique...).

On a GPU each of them drains the stream: the host stops issuing work until the device catches up, so
a round with several of them runs at the speed of its slowest round trip. Counted on any device (on
a CPU none of them waits, but the code that issues them is the code that would), so a test on a CPU
holds the GPU path to its budget.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_DATA_SIZED = {
    aten._local_scalar_dense,  # .item(), int(t), float(t), bool(t)
    aten.nonzero,
    aten.masked_select,
    aten._unique2,
    aten.unique_consecutive,
    aten.unique_dim,
    aten.is_nonzero,
    aten.equal,
    aten.repeat_interleave,
}
_READS = ("tolist", "cpu", "numpy")  # Tensor methods that hand the data to the host


class SyncCounter(TorchDispatchMode):
    """`with SyncCounter() as syncs: ...` then `syncs.count` (and `syncs.by_kind`)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_kind: Counter[str] = Counter()
        self._saved: dict[str, Any] = {}

    @property
    def count(self) -> int:
        return sum(self.by_kind.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket in _DATA_SIZED:
            self.by_kind[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> SyncCounter:
        for name in _READS:
            self._saved[name] = original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counted(name, original))
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)

    def _counted(self, name: str, original: Any) -> Any:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.by_kind[name] += 1
            return original(tensor, *args, **kwargs)

        return read
