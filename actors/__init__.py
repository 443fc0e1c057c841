"""One file per Ray role: the router and its lanes, the draft worker, the target replica and its
tensor-parallel shards; their configs, wire types, metrics and scaling signal. The classes are plain
Python: Ray decorators are applied in `deploy/` at build time.

May import: `speculative` (not its CPU kernels), ray, torch, deepspeed; never `deploy`.
"""
