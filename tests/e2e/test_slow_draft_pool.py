"""A draft pool that misses every deadline, through Serve's HTTP proxy: requests are still served.

Local Ray (CPU), the tiny pair of tests/front_router.py, `router.draft_timeout_s` 1 ms: every draft call
is late, so lanes decode without speculation. Serve's queue probes of the draft replica then run late
too, which once made a request with several choices hang (their admission calls shared one Serve
request id, and Serve's router gives a replica to one call per id: actors/pools.py, `own_request_id`).
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from ray import serve

from deploy.app import build_app
from deploy.config import AppConfig
from tests.actors.serve_helpers import free_port, local_ray, merged, run_app, small_cpu_args
from tests.front_router import MODEL_NAME, save_tiny_pair

pytestmark = pytest.mark.slow
LATE = {"draft_timeout_s": 0.001, "draft_timeout_per_token_s": 0.0, "draft_backoff_s": 0.5}


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    target, draft, _ = save_tiny_pair(tmp_path_factory.mktemp("late"))
    overrides = {"speculation": {"load_adaptive": False}, "router_pool": {"router": LATE}}
    config = AppConfig.model_validate(merged(small_cpu_args(target, draft, MODEL_NAME), overrides))
    port = free_port()
    with local_ray(num_cpus=4):
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        run_app(build_app(config), route_prefix="/")
        yield f"http://127.0.0.1:{port}/v1"


@pytest.mark.parametrize("n", [2, 1, 3, 2, 2])
def test_requests_with_several_choices_are_served_while_every_draft_call_is_late(base_url: str, n: int) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    done = client.completions.create(model=MODEL_NAME, prompt=[7, 8, 9], n=n, seed=3, temperature=1.0, max_tokens=4)
    assert [c.index for c in done.choices] == list(range(n))
    assert all(c.finish_reason in ("length", "stop") for c in done.choices)
