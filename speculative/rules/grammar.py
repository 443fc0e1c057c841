"""Structured output: a request's grammar as a token mask at every node of its tree (llguidance).

A `GrammarSpec` compiles once per tokenizer (`GrammarCompiler`, cached by spec) into a template
matcher; each sequence gets a copy advanced over its committed output tokens. That copy is soft
state keyed by sequence id: when the tokens it is sent disagree with what it consumed (a rollback,
a restart, another replica), it is rebuilt from them, as `ModelRunner.sync` rebuilds a cache. For
a tree, node i's mask is what the grammar allows after the committed output plus the draft tokens
on the path to node i: the path is consumed, the mask computed, the path rolled back.

Where the grammar is complete (accepting), the sequence's end tokens are allowed too, and where it
cannot go on they are all that is allowed, so a constrained sequence ends on EOS. A path (or
committed output) the grammar rejects is unreachable: the mask before its last token gave that
token probability 0, so no acceptance rule takes it. Its rows allow every token, only so that
their distributions stay defined.

The masks enter `processing.processed` as one more logits processor (-inf where disallowed), on
the target's logits and on the draft's alike: see docs/design.md, "Acceptance rules".
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np
import torch

from speculative.rules.sampling import GrammarSpec

# JSON as vLLM's llguidance backend compiles it, with whitespace between tokens bounded: an
# unbounded run lets a small model pad a value with newlines until max_tokens.
JSON_DEFAULTS: dict[str, Any] = {"whitespace_pattern": r"[ \n]{0,2}"}


class GrammarError(ValueError):
    """A grammar llguidance cannot compile."""


@cache
def _llguidance() -> Any:
    import llguidance  # a server without structured output never loads it
    import llguidance.hf

    return llguidance


def grammar_source(spec: GrammarSpec) -> str:
    """The llguidance grammar of a spec (text only: not yet checked)."""
    matcher = _llguidance().LLMatcher
    if spec.kind == "json_object":
        return str(matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS))
    if spec.kind == "json_schema":
        return str(matcher.grammar_from_json_schema(json.loads(spec.text), defaults=JSON_DEFAULTS))
    if spec.kind == "regex":
        return str(matcher.grammar_from_regex(spec.text))
    return str(matcher.grammar_from_lark(spec.text))


def grammar_error(spec: GrammarSpec) -> str | None:
    """Why llguidance cannot compile this grammar, or None when it can (no tokenizer needed)."""
    try:
        source = grammar_source(spec)
    except ValueError as e:
        return str(e)
    message = str(_llguidance().LLMatcher.validate_grammar(source))
    return None if not message or message.startswith("WARNING") else message


@dataclass
class _Sequence:
    matcher: Any  # llguidance.LLMatcher, advanced over `consumed`
    spec: GrammarSpec
    consumed: list[int] = field(default_factory=list)


class GrammarCompiler:
    """Grammars compiled for one tokenizer, and each sequence's matcher over its committed output.

    Thread-safe: a worker's verify calls may overlap."""

    def __init__(self, tokenizer: Any = None, max_sequences: int = 4096, load: Callable[[], Any] | None = None) -> None:
        """`tokenizer`: an `llguidance.LLTokenizer` (`from_hf` builds one from a Hugging Face tokenizer);
        or `load`, returning one at the first grammar (a server never asked for one never loads it)."""
        if (tokenizer is None) == (load is None):
            raise ValueError("a GrammarCompiler takes a tokenizer or a function loading one")
        self._tokenizer, self._load = tokenizer, load
        self._load_error: str | None = None
        self.max_sequences = max_sequences  # least recently used states beyond it are dropped (soft state)
        self._templates: dict[GrammarSpec, Any] = {}
        self._sequences: OrderedDict[str, _Sequence] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_hf(cls, hf_tokenizer: Any) -> GrammarCompiler:
        return cls(_llguidance().hf.from_tokenizer(hf_tokenizer))

    @classmethod
    def lazy(cls, load_hf_tokenizer: Callable[[], Any]) -> GrammarCompiler:
        """A compiler whose Hugging Face tokenizer is loaded at the first grammar."""
        return cls(load=lambda: _llguidance().hf.from_tokenizer(load_hf_tokenizer()))

    @property
    def tokenizer(self) -> Any:  # llguidance.LLTokenizer
        reason = self.unavailable()
        if reason is not None:
            raise GrammarError(f"grammar: structured output is not available for this model: {reason}")
        return self._tokenizer

    def unavailable(self) -> str | None:
        """Why this compiler has no tokenizer (loading it failed; the reason is kept), or None when it has one.
        Loads the tokenizer at the first call."""
        if self._tokenizer is None and self._load_error is None:
            assert self._load is not None
            try:
                self._tokenizer = self._load()
            except Exception as e:  # a tokenizer llguidance cannot read (no decoder, slow-only): no grammars
                self._load_error = f"its tokenizer cannot build grammar masks ({type(e).__name__}: {e})"
        return self._load_error

    @property
    def vocab(self) -> int:
        return int(self.tokenizer.vocab_size)

    def template(self, spec: GrammarSpec) -> Any:
        """The compiled matcher of a spec, at the start of the output (compiled once, then cached)."""
        found = self._templates.get(spec)
        if found is None:
            error = grammar_error(spec)
            if error is not None:
                raise GrammarError(f"grammar: {error}")
            found = self._templates[spec] = _llguidance().LLMatcher(self.tokenizer, grammar_source(spec), log_level=0)
            if found.is_error():
                del self._templates[spec]
                raise GrammarError(f"grammar: {found.get_error()}")
        return found

    def path_mask(
        self, seq_id: str, output: Sequence[int], spec: GrammarSpec, end_ids: frozenset[int] = frozenset()
    ) -> Callable[[list[list[int]], int], torch.Tensor]:  # processing.PathMask
        """Node masks for one sequence whose committed output is `output` (the tree's root last).
        `end_ids`: the sequence's end tokens, allowed wherever the grammar is complete."""
        with self._lock:
            state = self._synced(seq_id, list(output), spec)
        return lambda paths, vocab: self._masks(state, paths, vocab, end_ids)

    def release(self, seq_ids: Sequence[str]) -> None:
        with self._lock:
            for seq_id in seq_ids:
                self._sequences.pop(seq_id, None)

    def cached_sequences(self) -> int:
        return len(self._sequences)

    def _synced(self, seq_id: str, output: list[int], spec: GrammarSpec) -> _Sequence:
        state = self._sequences.get(seq_id)
        n = len(state.consumed) if state is not None else 0
        if state is None or state.spec != spec or state.consumed != output[:n]:
            state = _Sequence(self.template(spec).deep_copy(), spec)
            n = 0
        if len(output) > n:
            state.matcher.consume_tokens(output[n:])  # an error state: see `_masks`
            state.consumed = output
        self._sequences[seq_id] = state
        self._sequences.move_to_end(seq_id)
        while len(self._sequences) > self.max_sequences:
            self._sequences.popitem(last=False)
        return state

    def _masks(
        self, state: _Sequence, paths: list[list[int]], vocab: int, end_ids: frozenset[int]
    ) -> torch.Tensor:  # [N, V] bool
        ends = torch.tensor(sorted(t for t in end_ids if t < vocab), dtype=torch.long)
        allowed = torch.ones(len(paths), vocab, dtype=torch.bool)
        with self._lock:
            matcher = state.matcher
            if matcher.is_error():  # committed tokens the grammar rejects: unreachable, as a rejected path
                return allowed
            for row, path in enumerate(paths):
                taken = matcher.try_consume_tokens(path) if path else 0
                if taken == len(path):
                    allowed[row] = self._row(matcher, vocab, ends)
                if taken:
                    matcher.rollback(taken)
        return allowed

    def _row(self, matcher: Any, vocab: int, ends: torch.Tensor) -> torch.Tensor:  # [V] bool
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        row = torch.zeros(vocab, dtype=torch.bool)
        n = min(vocab, self.vocab)
        row[:n] = torch.from_numpy(bits[:n].astype(np.bool_))
        if matcher.is_accepting() or matcher.is_stopped():
            row[ends] = True
        return row


@cache
def compiler_for(model_path: str) -> GrammarCompiler:
    """The compiler of a model folder's tokenizer, built once per process (about a second)."""
    from transformers import AutoTokenizer

    return GrammarCompiler.from_hf(AutoTokenizer.from_pretrained(model_path))
