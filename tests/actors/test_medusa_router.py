"""Medusa served: the heads run on the target replica, their guesses come back with each verdict, and
the router's lane drafts the next tree from them (no draft pool, no extra hop).

The router and target replica are plain objects in one process (a tiny fp32 Llama target, random heads
laid out as Medusa initialises them, saved and loaded in the published layout).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from actors.config import MedusaHeadsConfig, ModelConfig, RouterConfig, TargetConfig
from actors.pools import LocalPool
from actors.router import Router
from actors.target_replica import LocalShards, TargetReplica
from actors.target_shard import TargetShard
from speculative.drafters.config import DrafterConfig
from speculative.drafters.medusa import DEFAULT_CHOICES, save_medusa
from tests.actors.conftest import TinyPair, hf_greedy, prompts_and_lengths
from tests.actors.test_router_local import run_all
from tests.tiny_models import heads_for


@pytest.fixture(scope="module")
def heads_dir(tiny_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory) -> str:
    target = AutoModelForCausalLM.from_pretrained(tiny_pair.target)
    return str(save_medusa(heads_for(target), tmp_path_factory.mktemp("medusa"), tiny_pair.target))


def medusa_router(target_path: str, heads: str, **router: object) -> Router:
    config = TargetConfig(model=ModelConfig(path=target_path, dtype="float32"), medusa=MedusaHeadsConfig(path=heads))
    target = TargetReplica(config, shards=LocalShards([TargetShard(config, 0)]))
    return Router(RouterConfig(medusa_choices=DEFAULT_CHOICES, **router), None, LocalPool([target]))  # type: ignore[list-item]


def test_greedy_identical_to_the_target_alone_with_head_drafts(tiny_pair: TinyPair, heads_dir: str) -> None:
    requests = prompts_and_lengths(8, seed=3)
    router = medusa_router(tiny_pair.target, heads_dir)
    results = asyncio.run(run_all(router, requests))  # all at once: one lane, a mixed batch
    alone = [asyncio.run(router.generate(p, {"temperature": 0.0, "max_tokens": m})) for p, m in requests[:3]]
    for (prompt, max_new), result in zip(requests, results + alone, strict=False):
        assert result["token_ids"] == hf_greedy(tiny_pair.target, prompt, max_new)
    for (prompt, max_new), result in zip(requests, alone, strict=False):
        assert result["token_ids"] == hf_greedy(tiny_pair.target, prompt, max_new)
    usage = [r["usage"] for r in results + alone]
    assert sum(u["drafted"] for u in usage) > 0, "the lane drafted from the heads' guesses"
    assert sum(u["accepted"] for u in usage) > 0, "and some were right"


def test_seeded_sampling_is_plain_sampling(tiny_pair: TinyPair, heads_dir: str) -> None:
    """Head drafts are deterministic (top-k), verified by matching the target's keyed sample: a seeded
    request's tokens are those of the same request without speculation."""
    router = medusa_router(tiny_pair.target, heads_dir)
    sampling = {"temperature": 0.8, "top_k": 20, "seed": 11, "max_tokens": 24}
    for prompt, _ in prompts_and_lengths(3, seed=5):
        on = asyncio.run(router.generate(prompt, sampling))
        off = asyncio.run(router.generate(prompt, sampling | {"max_draft_tokens": 0}))
        assert on["token_ids"] == off["token_ids"]


def test_heads_that_do_not_fit_the_target_are_refused(tiny_pair: TinyPair, tmp_path: Path) -> None:
    target = AutoModelForCausalLM.from_pretrained(tiny_pair.target)
    wrong = heads_for(target)
    wrong.medusa_head[0][-1].weight.data = wrong.medusa_head[0][-1].weight.data[:-1]  # one token short
    for head in wrong.medusa_head[1:]:
        head[-1].weight.data = head[-1].weight.data[:-1]
    folder = save_medusa(wrong, tmp_path / "heads")
    config = TargetConfig(
        model=ModelConfig(path=tiny_pair.target, dtype="float32"), medusa=MedusaHeadsConfig(path=str(folder))
    )
    with pytest.raises(ValueError, match=r"medusa\.path"):
        TargetShard(config, 0).load()


def test_drafter_kind_medusa_needs_its_heads() -> None:
    with pytest.raises(ValueError, match="medusa_heads"):
        DrafterConfig(kind="medusa")
    with pytest.raises(ValueError, match="medusa_top"):
        DrafterConfig(kind="medusa", medusa_heads="/x", medusa_choices=((0,), (5,)), medusa_top=4)
    with pytest.raises(ValueError, match="prefix"):
        DrafterConfig(kind="medusa", medusa_heads="/x", medusa_choices=((0, 1),))
