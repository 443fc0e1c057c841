"""The local run's Prometheus endpoint, scraped: Ray started as `make run` starts it (deploy/local/demo.py,
with its metrics export port), the application of tiny models deployed as `make run` deploys it, one
greedy request. Every Grafana panel's query then names metrics the endpoint shows, and vLLM's
acceptance-length query on the scraped counters equals the request's own 1 + accepted / drafts."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray import serve

from deploy.front.proxy_guard import PROXY_CALLBACK, PROXY_CALLBACK_ENV
from deploy.local.demo import deploy_local, start_local_ray
from tests.actors.serve_helpers import APP, REPO, free_port, merged, small_cpu_args
from tests.front_router import MODEL_NAME, save_tiny_pair
from tests.prometheus import Sample, evaluate_on_totals, panel_queries, query_metrics, samples, total

pytestmark = pytest.mark.slow
MAX_NEW = 24


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One greedy request on the local run: its usage and the metrics URL."""
    target, draft, _ = save_tiny_pair(tmp_path_factory.mktemp("metrics"))
    # The tiny draft costs as much as the tiny target: the load control would stop drafting.
    args = merged(small_cpu_args(target, draft, MODEL_NAME), {"speculation": {"load_adaptive": False}})
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", REPO)  # the workers import this checkout, not an installed copy
        env.setenv(PROXY_CALLBACK_ENV, PROXY_CALLBACK)  # set by start_local_ray; restored afterwards
        metrics = start_local_ray(args, metrics_port=free_port())
        try:
            deploy_local(args, free_port())
            prompt = [7, 8, 9, 10, 11, 7, 8, 9]
            sampling = {"temperature": 0.0, "max_tokens": MAX_NEW, "ignore_eos": True}
            done = serve.get_app_handle(APP).generate.remote(prompt, sampling).result(timeout_s=120)
            yield {"usage": done["usage"], "metrics": metrics}
        finally:
            serve.shutdown()
            ray.shutdown()


def scrape_until(url: str, done: Any, timeout_s: float = 60) -> list[Sample]:
    """Scrapes until `done(samples)`: Ray's workers report metrics to the agent every few seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(url, timeout=10) as r:
            scraped = samples(r.read().decode())
        if done(scraped) or time.monotonic() > deadline:
            return scraped
        time.sleep(2)


def counted(usage: dict[str, Any]) -> dict[str, float]:
    """What the endpoint's counters must read after the one request."""
    return {
        "ray_spec_decode_num_drafts_total": usage["drafts"],
        "ray_spec_decode_num_draft_tokens_total": usage["drafted"],
        "ray_spec_decode_num_accepted_tokens_total": usage["accepted"],
        "ray_spec_decode_num_accepted_tokens_per_pos_total": usage["accepted"],
        "ray_specserve_generated_tokens_total": usage["completion_tokens"],
    }


def test_counters_at_the_endpoint_are_the_requests_own(run: dict[str, Any]) -> None:
    usage, want = run["usage"], counted(run["usage"])
    assert usage["completion_tokens"] == MAX_NEW and usage["drafts"] > 0 and usage["accepted"] > 0, usage
    scraped = scrape_until(run["metrics"], lambda s: all(total(s, n) == v for n, v in want.items()))
    assert {n: total(scraped, n) for n in want} == want
    per_pos = {s.labels["position"] for s in scraped if s.name == "ray_spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {str(p) for p in range(len(per_pos))}  # 0-based, contiguous
    for position in per_pos:  # vLLM's position p is our depth p + 1
        ours = total(scraped, "ray_specserve_accepted_tokens_total", position=str(int(position) + 1))
        assert ours == total(scraped, "ray_spec_decode_num_accepted_tokens_per_pos_total", position=position)


def test_every_dashboard_query_names_metrics_the_endpoint_shows(run: dict[str, Any]) -> None:
    wanted = {name for exprs in panel_queries().values() for expr in exprs for name in query_metrics(expr)}
    scraped = scrape_until(run["metrics"], lambda s: wanted <= {x.name for x in s})
    missing = wanted - {s.name for s in scraped}
    assert not missing, f"dashboard metrics not at the endpoint: {sorted(missing)}"


def test_vllm_acceptance_length_on_the_scraped_counters_is_the_requests(run: dict[str, Any]) -> None:
    usage, want = run["usage"], counted(run["usage"])
    scraped = scrape_until(run["metrics"], lambda s: all(total(s, n) == v for n, v in want.items()))
    (query,) = panel_queries()["Acceptance length"]
    assert evaluate_on_totals(query, scraped) == pytest.approx(1 + usage["accepted"] / usage["drafts"])
