"""specserve's pure core: sampling, acceptance rules, token trees, the model runner and drafters.

Nothing in this package imports Ray; `actors/` wraps it and `deploy/` wires it.
"""
