"""CPU kernels for Linear layers: oneDNN with prepacked weights, and 4-bit weight groups with an
AVX-512 VNNI kernel of our own (`kernels/int4_vnni.c`, compiled on first use). Chosen once, at load
(`speculative.engine.loading`), which is the only importer of this package besides itself.

May import: torch; nothing else of specserve.
"""
