"""The Grafana dashboards and docs/metrics.md, offline: every query of specserve's dashboard, and of Ray Serve
LLM's vLLM dashboard (tests/fixtures/ray_serve_llm_panels.json) where specserve serves what it charts, reads only
metrics the code exports, under the names Ray's endpoint gives them; specserve's dashboard filters every panel by
application and model; the page lists each metric. tests/e2e/test_metrics_endpoint.py runs every one of these
queries on real scrapes."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from actors.metrics import ReplicaMetrics, RouterMetrics
from tests import ray_llm_panels
from tests.prometheus import dashboard, exported, panel_queries, query_metrics
from tests.ray_metrics import Recorder, fake_ray_metrics

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
# Serve's own metrics that the dashboards read: its proxies' HTTP errors by code, its replicas' requests
# (Ray's vLLM panels join on it for the deployment and replica labels).
SERVE_METRICS = {"ray_serve_num_http_error_requests_total", "ray_serve_deployment_request_counter_total"}


@pytest.fixture
def declared(monkeypatch: pytest.MonkeyPatch) -> dict[str, Recorder]:
    """Every metric a router, draft or target replica declares."""
    fake = fake_ray_metrics(monkeypatch)
    RouterMetrics("m")
    ReplicaMetrics("m")
    return fake.made


@pytest.fixture
def names(declared: dict[str, Recorder]) -> set[str]:
    """The metric names the endpoint can show: specserve's, and Serve's that the dashboards read."""
    return {n for r in declared.values() for n in exported(r.kind, r.name)} | SERVE_METRICS


def test_every_dashboard_query_names_a_metric_the_code_exports(names: set[str]) -> None:
    for title, exprs in panel_queries().items():
        for expr in exprs:
            read = query_metrics(expr)
            assert read and read <= names, f"{title}: {sorted(read - names)} not exported"


def test_ray_serve_llm_panels_read_metrics_the_code_exports(declared: dict[str, Recorder], names: set[str]) -> None:
    """Ray's vLLM dashboard on specserve: each panel it serves reads only exported metrics, under vLLM's names;
    and each family under a vLLM name is charted there or on specserve's dashboard."""
    panels = ray_llm_panels.load()["panels"]
    served = [p for p in panels if ray_llm_panels.served(p)]
    assert len(served) == 36 and len(panels) == 53  # (the fixture's Ray 2.60 dashboard)
    for panel in served:
        for expr in panel["exprs"]:
            read = query_metrics(expr)
            assert read and read <= names, f"{panel['title']}: {sorted(read - names)} not exported"
    ours = [e for exprs in panel_queries().values() for e in exprs]
    charted = {n for e in [e for p in served for e in p["exprs"]] + ours for n in query_metrics(e)}
    for recorder in declared.values():
        if recorder.name.startswith("vllm_"):
            assert exported(recorder.kind, recorder.name) & charted, f"no panel charts {recorder.name}"


def test_the_fixture_is_what_the_installed_ray_renders() -> None:
    fixture = ray_llm_panels.load()
    if fixture["ray_version"] != ray.__version__:
        pytest.skip(f"Ray {ray.__version__}, fixture of {fixture['ray_version']}: `python -m tests.ray_llm_panels`")
    assert ray_llm_panels.from_ray() == fixture


def test_every_metric_carries_the_model_name(declared: dict[str, Recorder]) -> None:
    for recorder in declared.values():
        assert "model_name" in recorder.tag_keys and recorder.default == {"model_name": "m"}, recorder.name


def test_the_dashboard_has_the_panels_operators_look_for() -> None:
    board, queries = dashboard(), panel_queries()
    wanted = {"Throughput", "Time to first token", "Inter-token latency", "Acceptance length"}
    wanted |= {"Acceptance by draft position", "Speculation depth in use", "Queue", "Replicas per pool"}
    wanted |= {"Pre-draft hit rate", "Request latency", "KV cache usage", "Rejected (HTTP 429)", "Errors"}
    assert wanted | {"Busy (autoscaling signal)"} <= queries.keys()
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    source, application, model = board["templating"]["list"]
    assert source["type"] == "datasource" and source["query"] == "prometheus"
    assert (application["name"], model["name"]) == ("application", "model")
    assert application["allValue"] == model["allValue"] == ".*" and "$application" in model["query"]["query"]
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    (length,) = queries["Acceptance length"]
    assert query_metrics(length) == {
        "ray_vllm_spec_decode_num_accepted_tokens_total",
        "ray_vllm_spec_decode_num_drafts_total",
    }


def test_every_panel_filters_by_application_and_model() -> None:
    """Serve's proxy metrics have no model_name: their queries filter by application alone."""
    for title, exprs in panel_queries().items():
        for expr in exprs:
            selectors = expr.count("{")
            assert expr.count('application=~"$application"') == selectors, title
            if not query_metrics(expr) & SERVE_METRICS:
                assert expr.count('model_name=~"$model"') == selectors, title


def test_query_metrics_sets_labels_ranges_and_functions_aside() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(a_bucket{x="y"}[$__rate_interval])))'
        " / on() group_left scalar(sum without (replica) (b)) and bool c offset 5m"
    )
    assert query_metrics(expr) == {"a_bucket", "b", "c"}


def test_docs_list_every_metric_under_its_endpoint_name(declared: dict[str, Recorder]) -> None:
    text = DOCS.read_text()
    for recorder in declared.values():
        shown = exported(recorder.kind, recorder.name)
        name = f"ray_{recorder.name}" if recorder.kind == "histogram" else shown.pop()
        assert f"`{name}`" in text, f"docs/metrics.md does not list {name}"
