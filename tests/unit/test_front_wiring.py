"""deploy.ingress.Ingress (what build_app deploys), over the real Router with in-process pools (no Ray cluster).

The same class Serve would run: the Router with both front-door mixins, its app built by
`__serve_build_asgi_app__`, the front door loaded from the target's folder (tokenizer and context
window) by `load_front_door`. Requests go through the real router, lanes, draft worker and target
replica; greedy output is the target's own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import ValidationError
from ray import serve
from ray.serve import Application

from actors.config import DraftWorkerConfig, ModelConfig, RouterConfig, TargetConfig
from actors.draft_worker import DraftWorker
from actors.loading import load_lm
from actors.pools import LocalPool
from actors.target_replica import LocalShards, TargetReplica
from actors.target_shard import TargetShard
from deploy.app import build_app
from deploy.config import DRAIN_MARGIN_S, AppConfig
from deploy.front.frontdoor import FrontDoorConfig
from deploy.ingress import Ingress
from proto import specserve_pb2 as pb
from speculative.engine.cpu.int4_linear import Int4Linear, float32_kernel
from speculative.engine.cpu.kquant import KQuantLinear
from speculative.engine.loading import native_bf16
from tests.front_router import MODEL_NAME, save_tiny_pair, tiny_tokenizer
from tests.tiny_models import reference_greedy

FRONT = FrontDoorConfig(served_model_name=MODEL_NAME)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    return save_tiny_pair(tmp_path_factory.mktemp("front"))


@pytest.fixture(scope="module")
def client(folders: tuple[Path, Path, Any]) -> Iterator[TestClient]:
    target_dir, draft_dir = str(folders[0]), str(folders[1])
    target_cfg = TargetConfig(model=ModelConfig(path=target_dir, dtype="float32"))
    target = TargetReplica(target_cfg, shards=LocalShards([TargetShard(target_cfg, 0)]))
    draft_cfg = DraftWorkerConfig(model=ModelConfig(path=draft_dir, dtype="float32"), target_model=target_dir)
    ingress = Ingress(
        FRONT, RouterConfig(), LocalPool([DraftWorker(draft_cfg)]), LocalPool([target]), tokenizer=target_dir
    )
    with TestClient(ingress.__serve_build_asgi_app__()) as c:
        yield c


def test_the_ingress_class_builds_a_serve_application() -> None:
    deployment = serve.deployment(name="router")(serve.ingress()(Ingress))
    app = deployment.bind(FRONT, RouterConfig(), None, None, tokenizer="unused")
    assert isinstance(app, Application)


def test_serve_drains_a_router_replica_for_its_longest_stream() -> None:
    """The router holds the streams: Serve's drain of a replica is max_stream_s plus the margin (not 20 s)."""
    config = {"target_model": "unused", "drafter": {"kind": "none"}, "router_pool": {"router": {"max_stream_s": 42}}}
    router = build_app(AppConfig.model_validate(config))._bound_deployment
    assert router.name == "router"
    assert router._deployment_config.graceful_shutdown_timeout_s == 42 + DRAIN_MARGIN_S


def test_real_router_behind_the_http_front_door(client: TestClient, folders: tuple[Path, Path, Any]) -> None:
    tokenizer = tiny_tokenizer()
    prompt = tokenizer.encode("the quick brown fox")
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    full = client.post("/v1/completions", json=body | {"return_token_ids": True}).json()
    assert full["choices"][0]["token_ids"] == reference_greedy(folders[2], prompt, 10)
    assert full["usage"]["acceptance_length"] >= 1.0
    stream = client.post("/v1/completions", json=body | {"stream": True}).text
    texts = [line for line in stream.split("\n\n") if line.startswith("data: {")]
    assert stream.endswith("data: [DONE]\n\n") and len(texts) >= 1
    models = client.get("/v1/models").json()["data"]
    assert models[0]["max_model_len"] == 1024  # the target config's max_position_embeddings
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200


def test_the_routers_own_checks_become_400s(client: TestClient) -> None:
    body = {"model": MODEL_NAME, "prompt": [5, 500], "max_tokens": 2}  # 500 is outside the 96-token vocabulary
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    streamed = client.post("/v1/completions", json=body | {"stream": True})
    assert streamed.status_code == 400 and "0..95" in streamed.json()["error"]["message"]
    assert client.get("/health").json() == {"status": "ok", "model": MODEL_NAME}


KV_BUDGET = 256  # under the tiny target's 1,024-token window: the window served is the budget


@pytest.fixture(scope="module")
def small_kv(folders: tuple[Path, Path, Any]) -> Iterator[tuple[TestClient, Ingress, TargetReplica]]:
    target_dir = str(folders[0])
    target_cfg = TargetConfig(model=ModelConfig(path=target_dir, dtype="float32"), kv_budget_tokens=KV_BUDGET)
    target = TargetReplica(target_cfg, shards=LocalShards([TargetShard(target_cfg, 0)]))
    ingress = Ingress(FRONT, RouterConfig(), None, LocalPool([target]), tokenizer=target_dir)
    with TestClient(ingress.__serve_build_asgi_app__()) as c:
        yield c, ingress, target


def test_the_front_doors_serve_the_window_the_kv_budget_allows(
    small_kv: tuple[TestClient, Ingress, TargetReplica],
) -> None:
    """/v1/models and gRPC Health report the budget; a request over it is a 400 naming the knob, and so is one
    whose `n` choices can never be held together; one that must wait for room is a 429 with Retry-After, served
    once the sequence holding the room is gone."""
    client, ingress, target = small_kv
    assert client.get("/v1/models").json()["data"][0]["max_model_len"] == KV_BUDGET
    health = client.portal.call(ingress.Health, pb.HealthRequest())  # type: ignore[union-attr]
    assert health.context_window == KV_BUDGET
    body = {"model": MODEL_NAME, "temperature": 0, "ignore_eos": True}
    over = client.post("/v1/completions", json=body | {"prompt": [5] * 250, "max_tokens": 10})
    error = over.json()["error"]
    assert over.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    assert f"context window of {KV_BUDGET} tokens" in error["message"]
    assert "target_pool.kv_budget_tokens" in error["message"]
    never = client.post("/v1/completions", json=body | {"prompt": [5, 6, 7, 8], "max_tokens": 96, "n": 3})
    error = never.json()["error"]  # 3 x 100 tokens: each fits, together they never will (a 429 on every retry)
    assert never.status_code == 400 and error["param"] == "n" and error["code"] == "context_length_exceeded"
    assert "need 300 KV tokens at once" in error["message"] and "target_pool.kv_budget_tokens" in error["message"]
    assert (
        client.post("/v1/completions", json=body | {"prompt": [5, 6, 7, 8], "max_tokens": 60, "n": 4}).status_code
        == 200
    )
    waiting = body | {"prompt": [5, 6, 7, 8], "max_tokens": 96}  # 100 tokens: fits the window, not what is left

    def ledger() -> int:
        return int(client.portal.call(target.describe)["kv_reserved_tokens"])  # type: ignore[union-attr]

    # Another router replica's sequence holds 200 tokens of the replica's budget (the replica keeps the ledger).
    assert client.portal.call(target.reserve, "other-router-0", 200).granted  # type: ignore[union-attr]
    refused = client.post("/v1/completions", json=waiting)
    assert refused.status_code == 429 and refused.headers["retry-after"] == str(FRONT.retry_after_s)
    message = refused.json()["error"]["message"]
    assert refused.json()["error"]["code"] == "overloaded" and "KV budget: 200 of 256" in message
    assert ledger() == 200, "a refused request holds nothing"
    client.portal.call(target.unreserve, ["other-router-0"])  # type: ignore[union-attr]
    served = client.post("/v1/completions", json=waiting)
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 96
    deadline = time.monotonic() + 30
    while ledger() and time.monotonic() < deadline:  # the lane releases it once it is empty
        time.sleep(0.05)
    assert ledger() == 0


def test_int8_quantizes_the_draft_alone_and_on_cpu_only(folders: tuple[Path, Path, Any]) -> None:
    """`draft_quantize: int8` (the CPU default's) loads the draft with int8 Linear weights and never the target."""
    config = {"target_model": "t", "draft_model": "d", "draft_quantize": "int8"}
    app = AppConfig.model_validate(config)
    draft = app.draft_worker()
    assert draft is not None and draft.model is not None and draft.model.quantize == "int8"
    assert app.target().model.quantize == "none"
    with pytest.raises(ValidationError, match="draft_quantize: 'int8' runs on CPU only"):
        AppConfig.model_validate({**config, "device": "cuda"})
    with pytest.raises(ValidationError, match="the target is never quantized"):
        TargetConfig(model=ModelConfig(path="t", quantize="int8"))
    loaded = load_lm(ModelConfig(path=str(folders[1]), dtype="bfloat16", quantize="int8"))
    assert not any(isinstance(m, torch.nn.Linear) for m in loaded.modules())
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}  # int8 kernels take float32 around them


def test_int4_and_auto_load_the_draft_in_4bit_groups_on_cpu_only(folders: tuple[Path, Path, Any]) -> None:
    """`draft_quantize: int4` loads the draft with 4-bit Linear layers: in bfloat16 where this CPU computes it
    natively (or the AVX2 GGUF kernel is not built), else in float32 on that kernel's Q4_1; `auto`
    (deploy/local.yaml's) is int4 where either runs, else int8; a GPU config refuses int4."""
    config = {"target_model": "t", "draft_model": "d", "draft_quantize": "int4"}
    with pytest.raises(ValidationError, match="draft_quantize: 'int4' runs on CPU only"):
        AppConfig.model_validate({**config, "device": "cuda"})
    AppConfig.model_validate({**config, "draft_quantize": "auto", "device": "cuda"})  # auto: none on a GPU
    loaded = load_lm(ModelConfig(path=str(folders[1]), dtype="float32", quantize="int4"))
    bf16 = native_bf16("cpu") or not float32_kernel()
    four_bit = Int4Linear if bf16 else KQuantLinear
    assert any(isinstance(m, four_bit) for m in loaded.modules())
    assert not any(isinstance(m, torch.nn.Linear) for m in loaded.modules())
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16 if bf16 else torch.float32}
    auto = load_lm(ModelConfig(path=str(folders[1]), quantize="auto"))
    assert any(isinstance(m, four_bit) for m in auto.modules()) == (native_bf16("cpu") or float32_kernel())


def test_local_yaml_fits_the_two_core_machine_it_is_written_for() -> None:
    """`serve run deploy/local.yaml` starts a Ray with this machine's cores as logical CPUs: the YAML's starting
    replicas reserve at most 2 of them, so the target replica is scheduled on a 2-core laptop (it reserved 2.6
    and never started there)."""
    from deploy.local.demo import app_block, reserved_cpus

    _, args = app_block(Path(__file__).resolve().parents[2] / "deploy" / "local.yaml")
    assert reserved_cpus(args) <= 2.0


def test_specserve_serve_model_flags_replace_the_configs_models_and_drafter() -> None:
    """`specserve serve MODEL --drafter lookup` over a config whose model drafter has tree fields: the target and
    served name are MODEL, no draft model, and the drafter block is replaced (merged, the tree fields would make
    a lookup drafter invalid)."""
    import argparse

    from deploy.local.cli import model_overrides
    from deploy.local.demo import app_block, merged_args, with_overrides

    _, args = app_block(Path(__file__).resolve().parents[2] / "deploy" / "local.yaml")
    args = merged_args(args, {"drafter": {"kind": "model", "tree_width": 2, "tree_nodes": 8}})
    flags = argparse.Namespace(model="smollm2-135m", draft=None, drafter="lookup", tp=None)
    config = AppConfig.model_validate(with_overrides(args, model_overrides(flags)))
    assert (config.target_model, config.draft_model, config.drafter.kind) == ("smollm2-135m", None, "lookup")
    assert config.front_door is not None and config.front_door.served_model_name == "smollm2-135m"
    flags = argparse.Namespace(model="qwen-1.5b", draft="qwen-0.5b", drafter=None, tp=None)
    config = AppConfig.model_validate(with_overrides(args, model_overrides(flags)))
    assert (config.draft_model, config.drafter.tree_width) == ("qwen-0.5b", 2), "the config's drafter kept"


def test_specserve_serve_qwen_with_its_draft_is_make_runs_config() -> None:
    """`specserve serve qwen-1.5b --draft qwen-0.5b` (vLLM's `vllm serve MODEL --speculative-config` form) builds
    the very application deploy/local.yaml describes: the same AppConfig, field for field."""
    import argparse

    from deploy.local.cli import model_overrides
    from deploy.local.demo import app_block, with_overrides

    _, args = app_block(Path(__file__).resolve().parents[2] / "deploy" / "local.yaml")
    flags = argparse.Namespace(model="qwen-1.5b", draft="qwen-0.5b", drafter=None, tp=None)
    one_line = AppConfig.model_validate(with_overrides(args, model_overrides(flags)))
    assert one_line == AppConfig.model_validate(args)
