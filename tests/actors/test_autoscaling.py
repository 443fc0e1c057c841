"""Each pool scales on its own busy time (actors/scaling.py), not on the other pool's load.

Draft-bound: a draft model much heavier than the target, drafting 6 tokens every step (adaptive
depth and the load control off): Serve adds a draft replica and no target replica. Target-bound: a
heavy target with the tiny draft model (~60x cheaper a token) drafting 1 token a step: Serve adds a
target replica and no draft replica. Both pools run the same autoscaling settings; only where the
work is differs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.config import AppConfig
from tests.actors.conftest import TinyPair, llama_config, prompts_and_lengths, save_noisy_copy, save_random
from tests.actors.serve_helpers import deployed, local_ray, replicas

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "signal": "busy",
    "target_busy": 0.6,
    "upscale_delay_s": 2.0,
    "downscale_delay_s": 600.0,
    "metrics_interval_s": 0.5,
    "look_back_period_s": 3.0,
}


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    with local_ray(num_cpus=8):
        yield


# Positions for requests that run until the pools have scaled: admission refuses a request whose prompt
# plus max_tokens (100,000) is over the window, which is at most the models' max_position_embeddings.
LONG = 1 << 17


@pytest.fixture(scope="module")
def light_pair(tmp_path_factory: pytest.TempPathFactory) -> TinyPair:
    """The tiny pair with a window for the long requests."""
    root = tmp_path_factory.mktemp("light")
    target = save_random(llama_config(max_position_embeddings=LONG), root / "target", seed=0)
    save_noisy_copy(target, root / "draft", noise=0.05, seed=1)
    return TinyPair(str(root / "target"), str(root / "draft"))


@pytest.fixture(scope="module")
def heavy_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Same vocabulary as the tiny pair, ~60x the compute per token."""
    path = tmp_path_factory.mktemp("heavy") / "m"
    shape = {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 6}
    config = llama_config(**shape, max_position_embeddings=LONG)
    save_random(config, Path(path), seed=9)
    return str(path)


def app(target: str, draft: str, depth: int) -> AppConfig:
    return AppConfig.model_validate(
        {
            "target_model": target,
            "draft_model": draft,
            "dtype": "float32",
            "torch_threads": 1,
            "drafter": {"kind": "model"},
            "speculation": {
                "adaptive": False,
                "max_depth": depth,
                "verify_token_budget": 1024,
                "shrink_when_queued": False,
                "load_adaptive": False,  # else the router stops drafting with a draft this heavy
            },
            "draft_pool": {"num_cpus": 0.5, "autoscaling": SCALING},
            "target_pool": {"shard_num_cpus": 0.5, "autoscaling": SCALING},
            "router_pool": {"router": {"max_lane_sequences": 2}},
        }
    )


def scale_under_load(config: AppConfig, grows: str, stays: str) -> tuple[int, int, float]:
    """Load 8 long requests (4 lanes) until `grows` has 2 replicas, then 6 s more; max counts seen."""
    requests = [(p, {"temperature": 0.0, "max_tokens": 100_000, "ignore_eos": True}) for p, _ in prompts_and_lengths(8)]
    with deployed(config) as handle:
        start = time.monotonic()
        responses = [handle.generate.remote(p, sp) for p, sp in requests]
        most = {grows: 1, stays: 1}
        grew_at = None
        while time.monotonic() - start < 150:
            for name in most:
                most[name] = max(most[name], replicas(name))
            if grew_at is None and most[grows] >= 2:
                grew_at = time.monotonic() - start
            if grew_at is not None and time.monotonic() - start > grew_at + 6:
                break
            time.sleep(0.5)
        stats = handle.stats.remote().result()
        print(f"{grows}-bound rounds: draft {stats['draft_s'] * 1e3:.1f} ms, verify {stats['verify_s'] * 1e3:.1f} ms")
        for response in responses:
            response.cancel()
    return most[grows], most[stays], grew_at if grew_at is not None else float("nan")


def test_draft_bound_load_scales_only_the_draft_pool(ray_local: None, light_pair: TinyPair, heavy_model: str) -> None:
    grown, other, after = scale_under_load(app(light_pair.target, heavy_model, 6), "draft", "target")
    print(f"draft-bound: draft replicas {grown} after {after:.1f}s, target replicas {other}")
    assert grown == 2 and other == 1


def test_target_bound_load_scales_only_the_target_pool(ray_local: None, light_pair: TinyPair, heavy_model: str) -> None:
    grown, other, after = scale_under_load(app(heavy_model, light_pair.draft, 1), "target", "draft")
    print(f"target-bound: target replicas {grown} after {after:.1f}s, draft replicas {other}")
    assert grown == 2 and other == 1
