"""speculative/rules/grammar.py over the toy tokenizer: node masks, per-sequence state, end tokens, errors.

Grammar (a|bc|cb|ba)+c? over the tokens "a" 0, "b" 1, "c" 2, "ab" 3, "ba" 4, "bc" 5, end 6.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from speculative.rules.grammar import GrammarCompiler, GrammarError, grammar_error
from speculative.rules.processing import NodeContext, node_context, processed, processes
from speculative.rules.sampling import GrammarSpec, SamplingParams
from speculative.rules.verify import argmax_decides
from tests.toy_grammar import TOY_END, toy_tokenizer

V = 7
SPEC = GrammarSpec(kind="regex", text="(a|bc|cb|ba)+c?")
END = frozenset({TOY_END})


def allowed(compiler: GrammarCompiler, output: list[int], paths: list[list[int]]) -> list[set[int]]:
    masks = compiler.path_mask("s", output, SPEC, END)(paths, V)  # [N, V]
    return [set(torch.nonzero(row).flatten().tolist()) for row in masks]


def test_each_node_gets_the_mask_after_its_own_path() -> None:
    compiler = GrammarCompiler(toy_tokenizer())
    root, after_b, after_c, after_b_c = allowed(compiler, [], [[], [1], [2], [1, 2]])
    assert root == {0, 1, 2, 3, 4, 5}  # no end before the first token
    assert after_b == {0, 2, 3}  # "b" goes on as "ba" or "bc"
    assert after_c == {1, 4, 5}  # "c" goes on as "cb"
    assert after_b_c == set(range(V))  # "bc" is complete: anything, the end included
    # the same nodes from committed output instead of a path: the same masks
    assert allowed(compiler, [1], [[], [2]]) == [after_b, after_b_c]


def test_a_complete_grammar_allows_only_the_end_and_a_rejected_path_allows_everything() -> None:
    compiler = GrammarCompiler(toy_tokenizer())
    done, rejected = allowed(compiler, [], [[0, TOY_END], [2, 2]])
    assert done == {TOY_END}  # stopped: the sequence ends
    assert rejected == set(range(V))  # "cc" is unreachable: any row keeps its distribution defined


def test_sequence_state_follows_the_tokens_it_is_sent() -> None:
    compiler = GrammarCompiler(toy_tokenizer())
    assert allowed(compiler, [1], [[]]) == [{0, 2, 3}]
    assert allowed(compiler, [1, 0], [[]]) == [set(range(V))]  # advanced by one token
    assert allowed(compiler, [2], [[]]) == [{1, 4, 5}]  # disagrees (a rollback): rebuilt
    assert compiler.cached_sequences() == 1
    compiler.release(["s", "unknown"])
    assert compiler.cached_sequences() == 0


def test_the_mask_enters_processing_as_minus_infinity() -> None:
    compiler = GrammarCompiler(toy_tokenizer())
    params = SamplingParams(temperature=0.0, grammar=SPEC)
    assert processes(params) and not argmax_decides(params)  # never the argmax-only fast path
    context = node_context("s", (0, 3, 1), 2, params, END, compiler)  # output so far: "b"
    logits = torch.zeros(2, V)
    out = processed(logits, context, [[], [2]], params)  # [2, V]
    assert torch.isneginf(out[0]).tolist() == [False, True, False, False, True, True, True]
    assert not torch.isneginf(out[1]).any()
    with pytest.raises(ValueError, match="no grammar compiler"):
        processed(logits, NodeContext((0, 3), 2), [[], [2]], params)


def test_min_tokens_never_leaves_a_row_without_tokens() -> None:
    """Where only the end is allowed and min_tokens bans it, the grammar wins (no all -inf row)."""
    compiler = GrammarCompiler(toy_tokenizer())
    params = SamplingParams(grammar=SPEC, min_tokens=5)
    context = node_context("s", (0, 0), 1, params, END, compiler)  # output "a"
    out = processed(torch.zeros(1, V), context, [[TOY_END]], params)
    assert torch.isfinite(out[0, TOY_END]) and int(torch.isfinite(out).sum()) == 1


def test_specs_are_checked() -> None:
    with pytest.raises(ValidationError, match="not JSON"):
        GrammarSpec(kind="json_schema", text="{nope")
    with pytest.raises(ValidationError, match="needs its text"):
        GrammarSpec(kind="regex")
    assert grammar_error(GrammarSpec(kind="json_schema", text='{"type": "object"}')) is None
    assert "unclosed" in (grammar_error(GrammarSpec(kind="regex", text="(ab")) or "")
    with pytest.raises(GrammarError):
        GrammarCompiler(toy_tokenizer()).template(GrammarSpec(kind="lark", text="start: undefined_rule"))
    params = SamplingParams(grammar=SPEC)
    assert SamplingParams.model_validate(params.model_dump()) == params  # travels as a dict


def test_a_lazy_compiler_loads_its_tokenizer_at_the_first_grammar() -> None:
    loads: list[int] = []

    def load() -> object:
        loads.append(1)
        return toy_tokenizer()

    compiler = GrammarCompiler(load=load)
    assert not loads
    assert allowed(compiler, [], [[]]) == [{0, 1, 2, 3, 4, 5}]
    assert allowed(compiler, [], [[]]) and len(loads) == 1
