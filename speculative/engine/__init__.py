"""Runs a model's forwards: the model runner over transformers, its KV cache (commit and rollback by
index), packing of ragged rows into one forward, loading weights in the chosen dtype and kernels, the
KV budget of a replica and the KV pool its runners draw on. `cpu/` holds the CPU kernels (oneDNN
prepacked Linear, int4 with its C kernel); only this package imports them.

May import: `speculative.rules`; torch, transformers.
"""
