"""The cores a forward's kernels run on, as the actors ask for them (they reach kernels only through the engine).

`borrowing(cores)`: inside the block, the GGUF weights' kernel (`cpu.kquant`) runs one thread per core of
`cores`, thread i >= 1 pinned to cores[i], the calling thread on its own: a target shard lends itself the
draft's idle core for a forward no draft call runs beside (`TargetSettings.borrow_cores`). Its threads split
a weight's outputs and never a sum, so a forward gives the same bits on any of them. Other kernels keep
torch's thread count.
"""

from __future__ import annotations

from speculative.engine.cpu.kquant import borrowing

__all__ = ["borrowing"]
