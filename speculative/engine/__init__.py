"""Runs a model's forwards: the model runner over transformers, its KV cache (commit and rollback by
index), packing of ragged rows into one forward, loading weights in the chosen dtype and kernels, and the
KV budget of a replica. `cpu/` holds the CPU kernels (oneDNN prepacked Linear, int4 with its C kernel);
only this package imports them.

May import: `speculative.rules`; torch, transformers.
"""
