"""Ray Serve LLM's Grafana dashboard for vLLM, its panel queries as Ray generates them, kept in
tests/fixtures/ray_serve_llm_panels.json (with the Ray version they come from) so the metrics tests run them
against specserve's endpoint: Ray's own LLM dashboard must work on specserve unchanged.

Source: ray/dashboard/modules/metrics/dashboards/serve_llm_dashboard_panels.py (the panels) and
serve_llm_grafana_dashboard_base.json (the template variables), rendered by
`ray.dashboard.modules.metrics.grafana_dashboard_factory.generate_serve_llm_grafana_dashboard()`.

    python -m tests.ray_llm_panels     # rewrite the fixture from the installed Ray
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "ray_serve_llm_panels.json"
SOURCE = (
    "ray/dashboard/modules/metrics/dashboards/serve_llm_dashboard_panels.py and serve_llm_grafana_dashboard_base.json, "
    "rendered by ray.dashboard.modules.metrics.grafana_dashboard_factory.generate_serve_llm_grafana_dashboard()"
)


# What some panels chart that specserve has not (metric name prefix -> why): those panels stay empty on specserve.
# Every other panel of the fixture returns values on specserve's endpoint (tests/e2e/test_metrics_endpoint.py).
NOT_SERVED = {
    "ray_vllm_num_requests_swapped": "vLLM v1 swaps nothing and no longer exports it; specserve reserves a "
    "sequence's whole KV at admission and never swaps or preempts",
    "ray_vllm_prefix_cache_": "no prefix cache: every request prefills its whole prompt",
    "ray_vllm_external_prefix_cache_": "no KV connector",
    "ray_vllm_nixl_": "no KV transfer between instances (NIXL, for disaggregated prefill)",
    "ray_vllm_kv_offload_": "no KV offload to CPU memory",
}


def served(panel: dict[str, Any]) -> bool:
    """Whether the panel reads nothing of NOT_SERVED."""
    return not any(prefix in expr for expr in panel["exprs"] for prefix in NOT_SERVED)


def _panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel with queries, those inside rows included, as {id, title, exprs}."""
    out = []
    for panel in board["panels"]:
        if panel.get("type") == "row":
            out += _panels({"panels": panel.get("panels", [])})
        elif panel.get("targets"):
            out.append({"id": panel["id"], "title": panel["title"], "exprs": [t["expr"] for t in panel["targets"]]})
    return out


def _defaults(board: dict[str, Any]) -> dict[str, str]:
    """Each template variable's value as the dashboard opens: "All" (its allValue) or its current value."""
    values = {}
    for variable in board["templating"]["list"]:
        if variable["type"] == "datasource":
            continue
        current = variable.get("current", {}).get("value")
        values[variable["name"]] = current if isinstance(current, str) else variable["allValue"]
    return values


def from_ray() -> dict[str, Any]:
    """The fixture's content, from the installed Ray."""
    import ray
    from ray.dashboard.modules.metrics.grafana_dashboard_factory import generate_serve_llm_grafana_dashboard

    board = json.loads(generate_serve_llm_grafana_dashboard()[0])
    return {"source": SOURCE, "ray_version": ray.__version__, "variables": _defaults(board), "panels": _panels(board)}


def load() -> dict[str, Any]:
    return dict(json.loads(FIXTURE.read_text()))


if __name__ == "__main__":
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(from_ray(), indent=1) + "\n")
