"""The real target at its stored precision: Qwen2.5-Coder 1.5B's Linear layers on its Q4_K_M GGUF tensors
(`target_weights: auto` in `deploy/local.yaml`), its forwards made batch invariant as a target replica makes
them. Greedy output with speculation (chain, tree, lookup and hybrid drafts from the quantized 0.5B draft the
YAML ships for this CPU) is plain decoding's on the same kernels, token for token, over the deterministic
check's 12 prompts and 4 chats, and a verify row's logits are the one-token step's bits.

Without the kernel's fixed reduction order (or without invariant attention beside it) a verify's rows round
unlike the steps', and greedy output parts from plain decoding on some prompts.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache

import pytest
import torch

from speculative.decoder import SpeculativeDecoder
from speculative.drafters.config import drafter_config
from speculative.engine import gguf_weights
from speculative.engine.cpu import kquant
from speculative.engine.invariant import make_deterministic
from speculative.engine.loading import (
    LoadedModel,
    chat_ids,
    load_dtype,
    load_model,
    resolve_dtype,
    resolve_quantize,
    with_kernels,
)
from speculative.engine.runner import ModelRunner
from speculative.planning.depth import DepthConfig
from speculative.rules.sampling import SamplingParams
from speculative.target import TargetVerifier
from tests.e2e.test_deterministic_bf16 import CHATS, COMPLETIONS, verify_rows_and_steps
from tests.fetched import fetched_dir, free_memory

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(kquant.library() is None, reason="no AVX2 CPU or no kernel build here"),
]

NEW_TOKENS = 64
DRAFTERS = {
    "chain": drafter_config(kind="model"),
    "tree": drafter_config(kind="model", tree_width=2, tree_nodes=8),
    "lookup": drafter_config(kind="lookup"),
    "hybrid": drafter_config(kind="hybrid"),
}


@cache
def stored_pair() -> tuple[LoadedModel, torch.nn.Module]:
    """The target on its GGUF tensors (invariant forwards) and the quantized draft, as `deploy/local.yaml` loads
    them on this CPU (`dtype: auto`, `draft_quantize: auto`: bfloat16 activations and the int4 draft where the
    CPU computes bfloat16 natively, float32 and the int8 draft elsewhere)."""
    folder = fetched_dir("qwen-1.5b")
    target = load_model(str(folder), resolve_dtype("auto"))
    path = gguf_weights.gguf_file(folder)
    assert path is not None, "modelstore keeps the GGUF file beside the converted weights"
    stored = gguf_weights.use_stored(target.model, path)
    assert stored.moved == {"Q4_K": 168, "Q6_K": 29} and not stored.dense
    assert make_deterministic(target.model) is None
    quantize = resolve_quantize("auto")
    draft = load_model(str(fetched_dir("qwen-0.5b")), load_dtype("auto", quantize))
    return target, with_kernels(draft.model, quantize, "onednn")


def prompts() -> list[list[int]]:
    tokenizer = stored_pair()[0].tokenizer
    return [chat_ids(tokenizer, c) for c in CHATS] + [tokenizer(c)["input_ids"] for c in COMPLETIONS]


def _generate(drafter: str | None, batch: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    target, draft = stored_pair()
    proposer = DRAFTERS[drafter].build(draft, target.model.config.vocab_size) if drafter is not None else None
    verifier = TargetVerifier(ModelRunner(target.model, lean=True))
    decoder = SpeculativeDecoder(verifier, proposer, DepthConfig(max_depth=6), eos_ids=target.eos_ids)
    return [o.output for o in decoder.generate(batch, SamplingParams(temperature=0.0, max_tokens=new_tokens))]


@cache
def plain_outputs(new_tokens: int = NEW_TOKENS) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts and their plain-decoding outputs on the stored weights (also the served test's reference)."""
    batch = prompts()
    return batch, _generate(None, batch, new_tokens)


def release_models() -> None:
    stored_pair.cache_clear()
    free_memory()


@pytest.fixture(scope="module", autouse=True)
def _freed_after() -> Iterator[None]:
    yield
    release_models()


def test_a_verify_row_is_the_one_token_steps_bits() -> None:
    target = stored_pair()[0].model
    verify_rows_and_steps(lambda: ModelRunner(target, lean=True), prompts()[1])


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_speculation_on_stored_weights_gives_plain_decodings_tokens(drafter: str) -> None:
    batch, expected = plain_outputs()
    got = _generate(drafter, batch)
    differ = [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
    assert not differ, f"{drafter}: prompts {differ} part from plain decoding"
