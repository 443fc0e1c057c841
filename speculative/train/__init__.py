"""Training draft heads (Medusa, EAGLE) for a target on its own outputs: `python -m speculative.train`.

May import: anything in `speculative`.
"""
