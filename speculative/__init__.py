"""specserve's pure core: the rules of exact speculation, the engine that runs models, the drafters, the
planner of draft depths, and their composition (the target's verifier, the in-process decoder).

Rooms, bottom up (docs/architecture.md; tests/unit/test_architecture.py keeps them true):
`rules/` -> `engine/` -> `drafters/` -> `planning/` -> `target.py`, `decoder.py` -> `train/`.
Nothing in this package imports Ray, `actors` or `deploy`.
"""
