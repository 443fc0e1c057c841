"""The Grafana dashboard and docs/metrics.md, offline: every panel's query reads only metrics the code
exports, under the names Ray's endpoint gives them, and the page lists each of them.
tests/e2e/test_metrics_endpoint.py finds the same names in a real scrape."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.metrics import RouterMetrics, mark_replica_up
from tests.prometheus import dashboard, exported, panel_queries, query_metrics
from tests.ray_metrics import Recorder, fake_ray_metrics

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


@pytest.fixture
def declared(monkeypatch: pytest.MonkeyPatch) -> dict[str, Recorder]:
    """Every metric a router, draft or target replica declares."""
    fake = fake_ray_metrics(monkeypatch)
    RouterMetrics()
    mark_replica_up()
    return fake.made


def test_every_dashboard_query_names_a_metric_the_code_exports(declared: dict[str, Recorder]) -> None:
    names = {n for r in declared.values() for n in exported(r.kind, r.name)}
    for title, exprs in panel_queries().items():
        for expr in exprs:
            read = query_metrics(expr)
            assert read and read <= names, f"{title}: {sorted(read - names)} not exported"


def test_the_dashboard_has_the_panels_operators_look_for() -> None:
    board, queries = dashboard(), panel_queries()
    wanted = {"Throughput", "Time to first token", "Inter-token latency", "Acceptance length"}
    wanted |= {"Acceptance by draft position", "Speculation depth in use", "Queue", "Replicas per pool"}
    assert wanted | {"Pre-draft hit rate"} <= queries.keys()
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    (variable,) = board["templating"]["list"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    (length,) = queries["Acceptance length"]
    assert query_metrics(length) == {"ray_spec_decode_num_accepted_tokens_total", "ray_spec_decode_num_drafts_total"}


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
