"""The same tokens in bfloat16: on the real Qwen pair with the target's forwards batch invariant (what
`target_pool.deterministic: auto` gives a bfloat16 CPU target), a verify row's logits are the one-token
step's bits, and greedy output with speculation (chain, tree, lookup, hybrid, Medusa, EAGLE drafts) is plain
decoding's, token for token, over 12 prompts of 128 tokens, each the same alone as beside 11 others.

Without the invariant kernels the libraries' kernels round a row by the forward's shape, and this fails (a
verify's rows differ from the steps', and greedy output parts from plain decoding on some prompts). Runs
where the CPU computes bfloat16 natively (where `dtype: auto` picks it); elsewhere there is nothing to show.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import cache

import pytest
import torch

from speculative.decoder import SpeculativeDecoder
from speculative.drafters.base import Drafter
from speculative.drafters.config import DrafterConfig, drafter_config, heads_factory
from speculative.drafters.heads import TreeDrafter
from speculative.engine.invariant import make_deterministic
from speculative.engine.loading import LoadedModel, chat_ids, load_model, resolve_dtype, with_kernels
from speculative.engine.runner import ModelRunner, chain_parents
from speculative.planning.depth import DepthConfig
from speculative.rules.sampling import SamplingParams
from speculative.target import TargetVerifier
from tests.fetched import fetched_dir, free_memory
from tests.tiny_models import eagle_for, heads_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(resolve_dtype("auto", "cpu") != "bfloat16", reason="this CPU has no native bfloat16"),
]

NEW_TOKENS = 128
CHATS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Rename the variable x to count in: x = 0\nfor item in items:\n    x += 1\nprint(x)",
    "List three colours and say why the sky is blue.",
    "Explain what a hash map is in two sentences.",
    "Write a SQL query that counts the orders per customer.",
    "What does `git rebase` do?",
]
COMPLETIONS = [
    "def quicksort(items):\n",
    "The three laws of thermodynamics are",
    "class Stack:\n    def __init__(self):\n",
    "import numpy as np\n\ndef softmax(x):\n",
    "Once upon a time, in a small village,",
    "# Read a CSV file and print the mean of each column\nimport csv\n",
]
DRAFTERS: dict[str, DrafterConfig] = {
    "chain": drafter_config(kind="model"),
    "tree": drafter_config(kind="model", tree_width=2, tree_nodes=8),
    "lookup": drafter_config(kind="lookup"),
    "hybrid": drafter_config(kind="hybrid"),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


@cache
def _pair() -> tuple[LoadedModel, LoadedModel]:
    """The Qwen pair in bfloat16, the target's Linear layers prepacked (`cpu_linear: onednn`, as
    deploy/local.yaml ships) and its forwards made batch invariant."""
    target = load_model(str(fetched_dir("qwen-1.5b")), "bfloat16")
    _heads(target.model)  # from the LM head's weights, before they are prepacked
    model = with_kernels(target.model, "none", "onednn")
    why = make_deterministic(model)
    if why is not None:
        pytest.skip(f"this machine's kernels: {why}")
    draft = load_model(str(fetched_dir("qwen-0.5b")), "bfloat16")
    return LoadedModel(model, target.tokenizer, target.eos_ids), draft


@cache
def _heads(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Random Medusa heads (their projections noisy copies of the LM head) and a random EAGLE head."""
    return {
        "medusa": heads_for(model, heads=2).to(torch.bfloat16),
        "eagle": eagle_for(model).to(torch.bfloat16),
    }


def _prompts(target: LoadedModel) -> list[list[int]]:
    tokenizer = target.tokenizer
    return [chat_ids(tokenizer, c) for c in CHATS] + [tokenizer(c)["input_ids"] for c in COMPLETIONS]


def _generate(drafter: str | None, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of `prompts` decoded together, drafted by `drafter` (None: plain decoding)."""
    target, draft = _pair()
    verifier, proposer = _decoding(drafter, target, draft)
    decoder = SpeculativeDecoder(verifier, proposer, DepthConfig(max_depth=4), eos_ids=target.eos_ids)
    return [o.output for o in decoder.generate(prompts, GREEDY)]


def _decoding(drafter: str | None, target: LoadedModel, draft: LoadedModel) -> tuple[TargetVerifier, Drafter | None]:
    """The verifier and the drafter of one run: heads beside the target (medusa, eagle), or a drafter."""
    vocab = target.model.config.vocab_size
    if drafter in ("medusa", "eagle"):
        random = _heads(target.model)[drafter]
        if drafter == "medusa":
            heads = heads_factory(random, target.model)  # type: ignore[arg-type]
        else:  # two candidates beside each other: a random head's drafts rarely land, and each depth costs an
            # LM-head pass over 151k tokens per row (deeper EAGLE trees: tests/unit/test_eagle.py, in float32)
            small = drafter_config(kind="eagle", eagle_head="(in memory)", eagle_top_k=2, eagle_depth=1, eagle_nodes=2)
            heads = small.trees(random, target.model)  # type: ignore[union-attr]
        verifier = TargetVerifier(runner := ModelRunner(target.model), heads=heads(runner))
        return verifier, TreeDrafter(verifier.drafted)
    proposer = DRAFTERS[drafter].build(draft.model, vocab) if drafter is not None else None
    return TargetVerifier(ModelRunner(target.model)), proposer


@cache
def plain_outputs() -> tuple[list[list[int]], list[list[int]]]:
    """The prompts and their plain-decoding outputs, decoded together (also the served test's reference)."""
    prompts = _prompts(_pair()[0])
    return prompts, _generate(None, prompts)


def release_models() -> None:
    """Free the Qwen pair and the heads (~7 GB): the suite's later tests start Ray replicas of their own, and
    a process holding these beside them leaves the machine's 24 GB short (workers are killed for memory)."""
    _pair.cache_clear()
    _heads.cache_clear()
    free_memory()


@pytest.fixture(scope="module", autouse=True)
def _freed_after() -> Iterator[None]:
    yield
    release_models()


@pytest.fixture(scope="module")
def plain() -> tuple[list[list[int]], list[list[int]]]:
    return plain_outputs()


def verify_rows_and_steps(make_runner: Callable[[], ModelRunner], prompt: list[int], n: int = 6) -> None:
    """Asserts a verify of `n` chained tokens after `prompt` gives, row by row, the bits of `n` one-token steps."""
    steps = make_runner()
    steps.add_rows(["a"])
    steps.extend([prompt[:-1]])
    tokens, logits = [prompt[-1]], []
    for _ in range(n):
        out = steps.forward([[tokens[-1]]], [[-1]], [[0]])
        assert out is not None
        steps.commit([[0]])
        logits.append(out[0])
        tokens.append(int(out[0].argmax()))
    verify = make_runner()
    verify.add_rows(["a"])
    verify.extend([prompt[:-1]])
    rows = verify.forward([tokens[:n]], [chain_parents(n)], [list(range(n))])
    assert rows is not None
    assert all(torch.equal(rows[i], logits[i]) for i in range(n))


def test_a_verify_row_is_the_one_token_steps_bits() -> None:
    target = _pair()[0].model
    verify_rows_and_steps(lambda: ModelRunner(target), chat_ids(_pair()[0].tokenizer, CHATS[1]))


@pytest.mark.parametrize("drafter", [*DRAFTERS, "medusa", "eagle"])
def test_speculation_gives_plain_decodings_tokens(plain: tuple[list[list[int]], list[list[int]]], drafter: str) -> None:
    prompts, expected = plain
    got = _generate(drafter, prompts)
    same = [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a == b]
    assert len(same) == len(prompts), f"{drafter}: prompts {sorted(set(range(len(prompts))) - set(same))} differ"


def test_a_request_is_the_same_alone_as_beside_others(plain: tuple[list[list[int]], list[list[int]]]) -> None:
    prompts, expected = plain
    for i in (1, 7):  # a chat and a completion, drafted alone: plain decoding's tokens beside 11 others
        assert _generate("chain", [prompts[i]]) == [expected[i]]
