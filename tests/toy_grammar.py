"""A grammar compiler over a toy tokenizer of 7 tokens (test_acceptance_distribution's vocabulary).

The tokens spell "a", "b", "c", "ab", "ba", "bc" and an end token; llguidance reads them through
its TokenizerWrapper, so the masks come from the same `GrammarCompiler` a server uses.
"""

from __future__ import annotations

from functools import cache

import llguidance

from speculative.rules.grammar import GrammarCompiler

TOY_TOKENS = [b"a", b"b", b"c", b"ab", b"ba", b"bc", b"<end>"]
TOY_END = 6


class ToyTokenizer:
    """The toy tokens as llguidance's TokenizerWrapper reads a tokenizer (greedy, longest first)."""

    eos_token_id, bos_token_id, tokens, special_token_ids = TOY_END, None, TOY_TOKENS, [TOY_END]

    def __call__(self, text: bytes | str) -> list[int]:
        data = text if isinstance(text, bytes) else text.encode()
        out, i = [], 0
        while i < len(data):
            tok = next(t for t in (3, 4, 5, 0, 1, 2) if data.startswith(TOY_TOKENS[t], i))
            out.append(tok)
            i += len(TOY_TOKENS[tok])
        return out


def toy_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(ToyTokenizer()), slices=[])


@cache
def toy_grammars() -> GrammarCompiler:
    return GrammarCompiler(toy_tokenizer())
