"""Every drafter kind but none, served: the app deploys what the kind needs and speculates with it.

One local Ray (CPU) for the module and the tiny Llama pair of the front-door tests (with random Medusa
heads and a random EAGLE head in their published layouts); each kind is deployed in turn and asked for a
greedy completion through Serve's HTTP proxy, which must be the target's own tokens with draft tokens > 0.
A hybrid must get a draft pool and draft with its model: before drafter configs said where each kind
runs, a served hybrid deployed no pool and drafted nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ray import serve

from deploy.app import build_app
from deploy.config import AppConfig
from speculative.drafters.eagle import save_eagle
from speculative.drafters.medusa import save_medusa
from tests.actors.serve_helpers import APP, free_port, local_ray, merged, run_app, small_cpu_args
from tests.e2e.test_front_doors import GREEDY, client, reference
from tests.front_router import MODEL_NAME, save_tiny_pair
from tests.tiny_models import eagle_for, heads_for

pytestmark = pytest.mark.slow

# Where each kind drafts, so what the app deploys beside the router and the target.
DEPLOYED = {
    "model": {"router", "draft", "target"},
    "hybrid": {"router", "draft", "target"},
    "lookup": {"router", "target"},
    "medusa": {"router", "target"},
    "eagle": {"router", "target"},
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Ray and Serve's HTTP proxy for the module, the tiny pair and the heads saved once."""
    root = tmp_path_factory.mktemp("kinds")
    target_dir, draft_dir, target = save_tiny_pair(root)
    drafters = {
        "model": {"kind": "model"},
        "hybrid": {"kind": "hybrid"},
        "lookup": {"kind": "lookup"},
        "medusa": {"kind": "medusa", "medusa_heads": str(save_medusa(heads_for(target), root / "m", str(target_dir)))},
        "eagle": {"kind": "eagle", "eagle_head": str(save_eagle(eagle_for(target), root / "e", str(target_dir)))},
    }
    port = free_port()
    with local_ray(num_cpus=4):
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield {"http": f"http://127.0.0.1:{port}", "root": root, "args": (target_dir, draft_dir), "drafters": drafters}


def _config(cluster: dict[str, Any], kind: str) -> AppConfig:
    # depths by acceptance alone: on tiny models a draft costs as much as it saves, and the load control
    # would (rightly) stop drafting
    overrides = {"drafter": cluster["drafters"][kind], "speculation": {"load_adaptive": False}}
    return AppConfig.model_validate(merged(small_cpu_args(*cluster["args"], MODEL_NAME), overrides))


@pytest.mark.parametrize("kind", list(DEPLOYED))
def test_a_served_kind_deploys_what_it_needs_and_speculates(cluster: dict[str, Any], kind: str) -> None:
    run_app(build_app(_config(cluster, kind)), route_prefix="/")
    try:
        assert set(serve.status().applications[APP].deployments) == DEPLOYED[kind]
        prompt = [7, 8, 9, 10, 11, 7, 8, 9]  # repeats: prompt lookup finds a match
        done = client(cluster).completions.create(model=MODEL_NAME, prompt=prompt, **GREEDY)
        assert done.choices[0].model_extra["token_ids"] == reference(Path(cluster["root"]), prompt)
        assert done.usage.model_extra["draft_tokens"] > 0, f"drafter kind {kind} speculated"
    finally:
        serve.delete(APP)
