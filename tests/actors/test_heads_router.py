"""Medusa and EAGLE served: the heads run on the target replica, the tree they draft comes back with each
verdict, and the router's lane drafts it, cut to the round's depth (no draft pool, no extra hop).

The router and target replica are plain objects in one process (a tiny fp32 Llama target; random Medusa
heads laid out as Medusa initialises them, a random EAGLE head near the identity; both saved and loaded
in their published layouts).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from actors.config import ModelConfig, RouterConfig, TargetConfig
from actors.pools import LocalPool
from actors.router import Router
from actors.target_replica import LocalShards, TargetReplica
from actors.target_shard import TargetShard
from speculative.drafters.config import drafter_config
from speculative.drafters.eagle import save_eagle
from speculative.drafters.medusa import save_medusa
from tests.actors.conftest import TinyPair, hf_greedy, prompts_and_lengths
from tests.actors.test_router_local import run_all
from tests.tiny_models import eagle_for, heads_for


@pytest.fixture(scope="module", params=["medusa", "eagle"])
def heads(request: pytest.FixtureRequest, tiny_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The target config's heads (the drafter config of their kind), saved in their published layout."""
    target = AutoModelForCausalLM.from_pretrained(tiny_pair.target)
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "medusa":
        return {
            "heads": drafter_config(
                kind="medusa", medusa_heads=str(save_medusa(heads_for(target), folder, tiny_pair.target))
            )
        }
    return {
        "heads": drafter_config(kind="eagle", eagle_head=str(save_eagle(eagle_for(target), folder, tiny_pair.target)))
    }


def heads_router(target_path: str, heads: dict, **router: object) -> Router:
    config = TargetConfig(model=ModelConfig(path=target_path, dtype="float32"), **heads)
    target = TargetReplica(config, shards=LocalShards([TargetShard(config, 0)]))
    return Router(RouterConfig(drafts_on_target=True, **router), None, LocalPool([target]))  # type: ignore[list-item]


def test_greedy_identical_to_the_target_alone_with_head_drafts(tiny_pair: TinyPair, heads: dict) -> None:
    requests = prompts_and_lengths(8, seed=3)
    router = heads_router(tiny_pair.target, heads)
    results = asyncio.run(run_all(router, requests))  # all at once: one lane, a mixed batch
    alone = [asyncio.run(router.generate(p, {"temperature": 0.0, "max_tokens": m})) for p, m in requests[:3]]
    for (prompt, max_new), result in zip(requests, results + alone, strict=False):
        assert result["token_ids"] == hf_greedy(tiny_pair.target, prompt, max_new)
    for (prompt, max_new), result in zip(requests, alone, strict=False):
        assert result["token_ids"] == hf_greedy(tiny_pair.target, prompt, max_new)
    usage = [r["usage"] for r in results + alone]
    assert sum(u["drafted"] for u in usage) > 0, "the lane drafted the heads' trees"
    assert sum(u["accepted"] for u in usage) > 0, "and some were right"


def test_seeded_sampling_is_plain_sampling(tiny_pair: TinyPair, heads: dict) -> None:
    """Head drafts are deterministic (top-k), verified by matching the target's keyed sample: a seeded
    request's tokens are those of the same request without speculation."""
    router = heads_router(tiny_pair.target, heads)
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
        model=ModelConfig(path=tiny_pair.target, dtype="float32"),
        heads=drafter_config(kind="medusa", medusa_heads=str(folder)),
    )
    with pytest.raises(ValueError, match=r"medusa_heads .* vocabulary"):
        TargetShard(config, 0).load()
    eagle = eagle_for(target)
    eagle.shape = replace(eagle.shape, vocab=eagle.shape.vocab + 1)  # a head for another vocabulary
    config = TargetConfig(
        model=ModelConfig(path=tiny_pair.target, dtype="float32"),
        heads=drafter_config(kind="eagle", eagle_head=str(save_eagle(eagle, tmp_path / "eagle"))),
    )
    with pytest.raises(ValueError, match=r"eagle_head .* vocabulary"):
        TargetShard(config, 0).load()


def test_drafter_kinds_on_the_target_need_their_heads() -> None:
    with pytest.raises(ValueError, match="eagle_head"):
        drafter_config(kind="eagle")
    with pytest.raises(ValueError, match="medusa_heads"):
        drafter_config(kind="medusa")
    with pytest.raises(ValueError, match="medusa_top"):
        drafter_config(kind="medusa", medusa_heads="/x", medusa_choices=((0,), (5,)), medusa_top=4)
    with pytest.raises(ValueError, match="prefix"):
        drafter_config(kind="medusa", medusa_heads="/x", medusa_choices=((0, 1),))
