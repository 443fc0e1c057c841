"""The application config and the Serve YAMLs, without starting Ray."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from pydantic import ValidationError
from ray.serve import Application
from ray.serve.schema import ServeDeploySchema

from deploy.app import app_builder
from deploy.config import AppConfig, Autoscaling

YAMLS = sorted((Path(__file__).resolve().parents[2] / "deploy").glob("*.yaml"))


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_yaml_is_a_serve_config_whose_args_build(path: Path) -> None:
    schema = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    for app in schema.applications:
        assert app.import_path == "deploy.app:app_builder"
        assert isinstance(app_builder(app.args), Application)


def test_a_draft_pool_only_for_a_draft_model() -> None:
    """Prompt lookup is drafted by the router: a draft pool would hold replicas (GPUs) no call reaches. A
    hybrid drafts by lookup and its model in the draft pool."""
    for kind in ("lookup", "none"):
        args = {"target_model": "t", "drafter": {"kind": kind}, "draft_pool": {"num_gpus": 1}}
        config = AppConfig.model_validate(args)
        assert config.draft_worker() is None
    for drafter in ({}, {"kind": "hybrid"}):
        config = AppConfig.model_validate({"target_model": "t", "draft_model": "d", "drafter": drafter})
        worker = config.draft_worker()
        assert worker is not None and worker.model is not None and worker.model.path == "d"
        assert worker.drafter == config.drafter and config.target().heads is None
    with pytest.raises(ValidationError, match="draft_model: drafter kind 'hybrid' needs a draft model"):
        AppConfig.model_validate({"target_model": "t", "drafter": {"kind": "hybrid"}})


def test_each_kind_takes_only_its_own_fields() -> None:
    """The YAML shape of every kind validates; a field of another kind is an error naming it."""
    shapes = [
        {"tree_width": 2, "tree_nodes": 8, "sampled": False, "lookup_quotes": False},
        {"kind": "hybrid", "tree_width": 2, "max_ngram": 4, "min_ngram": 2},
        {"kind": "lookup", "max_ngram": 4, "min_ngram": 2},
        {"kind": "medusa", "medusa_heads": "/h", "medusa_choices": [[0], [1], [0, 0]], "medusa_top": 2},
        {"kind": "eagle", "eagle_head": "/h", "eagle_top_k": 2, "eagle_depth": 3, "eagle_nodes": 8},
        {"kind": "none"},
    ]
    for shape in shapes:
        config = AppConfig.model_validate({"target_model": "t", "draft_model": "d", "drafter": shape})
        assert config.drafter.kind == shape.get("kind", "model")
        assert (config.target().heads is not None) == (config.drafter.runs_on == "target")
    for shape, field in (
        ({"kind": "lookup", "tree_width": 2}, "tree_width"),
        ({"kind": "eagle", "eagle_head": "/h", "medusa_top": 2}, "medusa_top"),
    ):
        with pytest.raises(ValidationError, match=field):
            AppConfig.model_validate({"target_model": "t", "drafter": shape})


def test_lookup_quotes_hold_beside_a_draft_model_alone() -> None:
    """`drafter.lookup_quotes` (on by default) reaches the router beside a draft model; without one the
    router's lookup, if any, drafts every sequence."""
    expected = {"model": (True, (3, 1)), "lookup": (False, (3, 1)), "hybrid": (False, None), "none": (False, None)}
    for kind, (quotes, ngrams) in expected.items():
        args = {"target_model": "t", "draft_model": "d", "drafter": {"kind": kind}}
        router = AppConfig.model_validate(args).router()
        assert (router.lookup_quotes, router.lookup_ngrams) == (quotes, ngrams), kind
    args = {"target_model": "t", "draft_model": "d", "drafter": {"lookup_quotes": False}}
    off = AppConfig.model_validate(args).router()
    assert (off.lookup_quotes, off.lookup_ngrams) == (False, None)


def test_bundles_one_per_shard_replica_rides_in_the_first() -> None:
    config = AppConfig.model_validate(
        {
            "target_model": "t",
            "draft_model": "d",
            "tp_size": 2,
            "target_pool": {"shard_num_cpus": 2, "shard_num_gpus": 1, "replica_num_cpus": 0.5},
        }
    )
    assert config.target_pool.bundles(config.tp_size) == [{"CPU": 2.5, "GPU": 1}, {"CPU": 2.0, "GPU": 1}]


def test_pools_carry_their_node_type_resources() -> None:
    config = AppConfig.model_validate(
        {
            "target_model": "t",
            "draft_model": "d",
            "tp_size": 2,
            "draft_pool": {"num_cpus": 1, "num_gpus": 1, "resources": {"draft_node": 0.01}, "accelerator_type": "L4"},
            "target_pool": {"shard_num_cpus": 2, "resources": {"target_node": 0.01}, "accelerator_type": "A100"},
        }
    )
    assert config.draft_pool.actor_options() == {
        "num_cpus": 1,
        "num_gpus": 1,
        "resources": {"draft_node": 0.01},
        "accelerator_type": "L4",
    }
    marker = {"target_node": 0.01, "accelerator_type:A100": 0.001}
    assert config.target_pool.bundles(config.tp_size) == [{"CPU": 2.1, **marker}, {"CPU": 2.0, **marker}]
    plain = AppConfig.model_validate({"target_model": "t", "draft_model": "d"})
    assert plain.draft_pool.actor_options() == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert plain.target_pool.bundles(plain.tp_size) == [{"CPU": 1.1}]


def test_autoscaling_options() -> None:
    assert Autoscaling(min_replicas=2, max_replicas=2).serve_options() == {"num_replicas": 2}
    busy = Autoscaling(max_replicas=3, target_busy=0.5).serve_options()["autoscaling_config"]
    assert busy["policy"] == {
        "policy_function": "actors.scaling:BusyFractionPolicy",
        "policy_kwargs": {"target_busy": 0.5},
    }
    queue = Autoscaling(max_replicas=3, signal="queue", target_ongoing_requests=8).serve_options()
    assert queue["autoscaling_config"]["target_ongoing_requests"] == 8


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"target_model": "t"}, "draft_model"),  # kind model needs a draft
        ({"target_model": "t", "drafter": {"kind": "lookup"}, "tp_size": 0}, "tp_size"),
        ({"target_model": "t", "drafter": {"kind": "none"}, "draft_pool": {"autoscaling": {"min_replicas": 3}}}, "min"),
        ({"target_model": "t", "drafter": {"kind": "none"}, "dtype": "int8"}, "dtype"),
        ({"target_model": "t", "drafter": {"kind": "none"}, "unknown": 1}, "unknown"),
        ({"target_model": "t", "drafter": {"kind": "none"}, "target_pool": {"resources": {"GPU": 1}}}, "resources"),
        ({"target_model": "t", "drafter": {"kind": "none"}, "draft_pool": {"resources": {"x": -1}}}, "resources"),
        ({"target_model": "t", "drafter": {"kind": "none"}, "draft_pool": {"accelerator_type": "A 100"}}, "accel"),
    ],
)
def test_bad_config_names_the_field(args: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        AppConfig.model_validate(args)


def test_busy_policy_sums_replicas() -> None:
    from actors.scaling import BUSY_METRIC, BusyFractionPolicy

    def ctx(busy: dict[str, float] | None) -> SimpleNamespace:
        metrics = {BUSY_METRIC: busy} if busy is not None else {}
        return SimpleNamespace(
            target_num_replicas=1, capacity_adjusted_min_replicas=1, policy_state={}, aggregated_metrics=metrics
        )

    policy = BusyFractionPolicy(0.6)
    assert policy(ctx({"a": 0.9, "b": 0.5}))[0] == 3  # 1.4 / 0.6 -> 3
    assert policy(ctx({"a": 0.2}))[0] == 1
    assert policy(ctx({"a": 0.0}))[0] == 1  # idle: min_replicas
    assert policy(ctx(None))[0] == 1  # no reports yet: hold


def test_busy_meter() -> None:
    from actors.scaling import BusyMeter

    now = [0.0]
    meter = BusyMeter(clock=lambda: now[0])
    meter.start()
    now[0] = 3.0
    meter.stop()
    now[0] = 4.0
    assert meter.take() == pytest.approx(0.75)
    meter.start()
    now[0] = 6.0
    assert meter.take() == pytest.approx(1.0)  # a running call counts up to now
    now[0] = 8.0
    meter.stop()
    assert meter.take() == pytest.approx(1.0)


def test_lane_affinity_pins_balance_and_follow_scaling() -> None:
    from actors.affinity import least_loaded, rebalance

    pins: dict[str, str] = {}
    for lane in ("a", "b", "c", "d"):
        pins[lane] = least_loaded(pins, ["r1", "r2"], lambda r: 0)
    assert sorted(pins.values()) == ["r1", "r1", "r2", "r2"]
    grown = rebalance(dict(pins), ["r1", "r2", "r3"])  # scale-up: the new replica takes a lane at once
    assert sorted(grown.values()).count("r3") == 1 and sum(grown[k] == pins[k] for k in pins) == 3
    shrunk = rebalance(grown, ["r3"])  # r1 and r2 left: their lanes re-pin on their next call
    assert shrunk == {k: "r3" for k, v in grown.items() if v == "r3"}
    assert least_loaded({}, ["r1", "r2"], lambda r: {"r1": 5, "r2": 0}[r]) == "r2"  # tie: shorter queue
