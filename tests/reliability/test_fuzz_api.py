"""Fuzzed input against the OpenAI HTTP API over the real router (tiny models, one process, a real socket).

- schemathesis generates requests from the app's own OpenAPI document (valid and invalid bodies
  for every operation): no answer is a 5xx.
- hypothesis sends arbitrary JSON, and objects with the API's own keys and arbitrary values: the
  answer is a completion, or a 4xx whose OpenAI error body names the field at fault.
- Afterwards the router holds no sequence, no cache holds one, and a valid request is answered:
  nothing a client sent crashed it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.config import DraftWorkerConfig, ModelConfig, RouterConfig, TargetConfig
from actors.draft_worker import DraftWorker
from actors.pools import LocalPool
from actors.target_replica import LocalShards, TargetReplica
from actors.target_shard import TargetShard
from deploy.front.frontdoor import FrontDoorConfig
from deploy.ingress import Ingress
from deploy.openai.api import ChatCompletionRequest, CompletionRequest
from tests.front_router import MODEL_NAME, save_tiny_pair, serve_in_thread

pytestmark = pytest.mark.slow  # ~40 s: hundreds of requests through the real router
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def ingress(tmp_path_factory: pytest.TempPathFactory) -> Ingress:
    """The real router with both front doors; a small context window keeps fuzzed generations short."""
    target_dir, draft_dir, _ = save_tiny_pair(Path(tmp_path_factory.mktemp("fuzz")))
    target_cfg = TargetConfig(model=ModelConfig(path=str(target_dir), dtype="float32"))
    target = TargetReplica(target_cfg, shards=LocalShards([TargetShard(target_cfg, 0)]))
    draft_cfg = DraftWorkerConfig(model=ModelConfig(path=str(draft_dir), dtype="float32"), target_model=str(target_dir))
    front = FrontDoorConfig(served_model_name=MODEL_NAME, context_window=48)
    pools = LocalPool([DraftWorker(draft_cfg)]), LocalPool([target])
    return Ingress(front, RouterConfig(), *pools, tokenizer=str(target_dir))


@pytest.fixture(scope="module")
def base_url(ingress: Ingress) -> Iterator[str]:
    with serve_in_thread(ingress.__serve_build_asgi_app__()) as url:
        yield url


@pytest.fixture(scope="module")
def api_schema(base_url: str) -> Any:
    return schemathesis.openapi.from_url(base_url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@FUZZ
def test_schemathesis_finds_no_server_error(case: Any) -> None:
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL_NAME  # past the model check, into tokenizing and the router
    response = case.call(timeout=60)
    assert response.status_code < 500, (json.dumps(case.body), response.text[:500])


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


def keyed_bodies(model: type[CompletionRequest | ChatCompletionRequest]) -> st.SearchStrategy[dict[str, Any]]:
    """Objects with the request's own keys (the model's name always right) and arbitrary values."""
    keys = sorted(set(model.model_fields) - {"model"})
    return st.fixed_dictionaries({"model": st.just(MODEL_NAME)}, optional={k: JSON for k in keys})


def check_answer(response: requests.Response) -> None:
    assert response.status_code < 500, response.text[:500]
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"]
        if error.get("param"):
            assert error["param"].split(".")[0] in error["message"], error
    elif response.headers["content-type"].startswith("application/json"):
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


@FUZZ
@given(body=JSON | keyed_bodies(CompletionRequest), raw=st.binary(max_size=40))
def test_any_json_to_completions_is_answered_or_refused_by_field(base_url: str, body: Any, raw: bytes) -> None:
    check_answer(requests.post(base_url + "/v1/completions", data=json.dumps(body), timeout=60))
    check_answer(requests.post(base_url + "/v1/completions", data=raw, timeout=60))


@FUZZ
@given(body=JSON | keyed_bodies(ChatCompletionRequest))
def test_any_json_to_chat_is_answered_or_refused_by_field(base_url: str, body: Any) -> None:
    check_answer(requests.post(base_url + "/v1/chat/completions", data=json.dumps(body), timeout=60))


def test_nothing_crashed_and_nothing_is_held(base_url: str, ingress: Ingress) -> None:
    body = {"model": MODEL_NAME, "prompt": "the quick brown fox", "max_tokens": 4, "temperature": 0}
    ok = requests.post(base_url + "/v1/completions", json=body, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    assert requests.get(base_url + "/health", timeout=60).json()["status"] == "ok"
    assert not ingress._live, "every fuzzed stream ended"
    target: TargetReplica = ingress._target.replicas[0]  # type: ignore[attr-defined]
    draft: DraftWorker = ingress._draft.replicas[0]  # type: ignore[attr-defined]
    assert target.shards.shards[0].describe()["sequences"] == 0  # type: ignore[attr-defined]
    assert draft._describe()["sequences"] == 0
