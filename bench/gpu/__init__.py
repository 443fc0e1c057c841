"""The GPU benchmark: the speculative core on real model shapes with random weights and oracle drafts.

`python -m bench.gpu` (or `bash bench/gpu.sh OUT_DIR`) runs it; `run` holds the sections' order and
budgets, `sections` the measurements, `forward_cost` the eager and CUDA-graph forward timings,
`oracle` the drafter of set acceptance, `random_models` the no-download models, `report` the tables
and the figure.
"""
