"""CPU kernels for Linear layers: oneDNN with prepacked weights, int8 weights with an AVX2 kernel of our own
(`kernels/int8_avx2.c`) beside torch's int8 kernels, and 4-bit weight groups with an AVX-512 VNNI kernel of our
own (`kernels/int4_vnni.c`); our kernels are built at install (`compiled`).
Chosen once, at load (`speculative.engine.loading`), which is the only importer of this package besides itself.

May import: torch; nothing else of specserve.
"""
