"""The rules that make speculation exact: sampling transforms, acceptance (greedy, rejection, target-sample
matching), per-sequence verification, token trees, the keyed random streams, stop conditions, grammars
and log probabilities. Pure functions and frozen data over tensors.

May import: torch, numpy, llguidance; nothing else of specserve.
"""
