"""Served applications with drafter kinds medusa and eagle, through Serve's HTTP and gRPC proxies.

Local Ray (CPU), the tiny Llama target of the front-door tests with random Medusa heads or a random EAGLE
head saved in their published layouts: no draft pool is deployed; the target replica runs the heads and
the router drafts their trees. The official `openai` client and a grpcio client get the target's own
greedy tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ray import serve

from deploy.app import build_app
from deploy.config import AppConfig
from deploy.front.grpc_decoding import GRPC_SERVICER_FUNCTIONS
from speculative.drafters.eagle import save_eagle
from speculative.drafters.medusa import save_medusa
from tests.actors.serve_helpers import free_port, local_ray, merged, run_app, small_cpu_args
from tests.e2e.test_front_doors import GREEDY, client, grpc_greedy, reference
from tests.front_router import MODEL_NAME, save_tiny_pair
from tests.tiny_models import eagle_for, heads_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["medusa", "eagle"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp(f"{request.param}-e2e")
    target_dir, draft_dir, target = save_tiny_pair(root)
    if request.param == "medusa":
        drafter = {
            "kind": "medusa",
            "medusa_heads": str(save_medusa(heads_for(target), root / "heads", str(target_dir))),
        }
    else:
        drafter = {"kind": "eagle", "eagle_head": str(save_eagle(eagle_for(target), root / "head", str(target_dir)))}
    # depths by acceptance alone: on a tiny model a 15-node tree can cost more than it saves, and the load
    # control would then leave the heads' trees undrafted (the output is the same either way)
    speculation = {"load_adaptive": False}
    args = merged(small_cpu_args(target_dir, draft_dir, MODEL_NAME), {"drafter": drafter, "speculation": speculation})
    config = AppConfig.model_validate(args)
    assert config.draft_worker() is None, "no draft pool: the heads run on the target replica"
    http_port, grpc_port = free_port(), free_port()
    with local_ray(num_cpus=4):
        serve.start(
            http_options={"host": "127.0.0.1", "port": http_port},
            grpc_options={"port": grpc_port, "grpc_servicer_functions": GRPC_SERVICER_FUNCTIONS},
        )
        run_app(build_app(config), route_prefix="/")
        yield {"http": f"http://127.0.0.1:{http_port}", "grpc": f"127.0.0.1:{grpc_port}", "root": root}


def test_openai_completions_equal_the_target(served: dict) -> None:
    drafted = 0
    for prompt in ([7, 8, 9, 10, 11, 7, 8], [20, 21, 22, 23, 24, 25]):
        expected = reference(served["root"], prompt)
        done = client(served).completions.create(model=MODEL_NAME, prompt=prompt, **GREEDY)
        assert done.choices[0].model_extra["token_ids"] == expected
        drafted += done.usage.model_extra["draft_tokens"]
        chunks = list(client(served).completions.create(model=MODEL_NAME, prompt=prompt, stream=True, **GREEDY))
        streamed = [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [] if c.choices else [])]
        assert streamed == expected
    assert drafted > 0, "the router drafted the heads' trees"


def test_grpc_unary_and_stream_equal_the_target(served: dict) -> None:
    prompt = [12, 13, 14, 15, 12, 13]
    unary, streamed = grpc_greedy(served["grpc"], prompt)
    assert list(unary.token_ids) == streamed == reference(served["root"], prompt)
