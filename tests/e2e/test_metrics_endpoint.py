"""The local run's Prometheus endpoint, scraped: Ray started as `make run` starts it (deploy/local/demo.py,
with its metrics export port), the application of tiny models deployed as `make run` deploys it, one
greedy request. Every Grafana panel's query then names metrics the endpoint shows, and vLLM's
acceptance-length query on the scraped counters equals the request's own 1 + accepted / drafts. On the same
run, through Serve's proxy as `make run` installs it: a client that leaves mid-stream stops its request's
generation, `x-request-disconnect-disabled` or not."""

from __future__ import annotations

import json
import socket
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray import serve

from deploy.front.proxy_guard import PROXY_CALLBACK, PROXY_CALLBACK_ENV
from deploy.local.demo import deploy_local, start_local_ray
from tests.actors.serve_helpers import APP, REPO, free_port, merged, small_cpu_args, wait_until
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
            url = deploy_local(args, free_port())
            prompt = [7, 8, 9, 10, 11, 7, 8, 9]
            sampling = {"temperature": 0.0, "max_tokens": MAX_NEW, "ignore_eos": True}
            done = serve.get_app_handle(APP).generate.remote(prompt, sampling).result(timeout_s=120)
            yield {"usage": done["usage"], "metrics": metrics, "url": url}
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


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_stops_its_request_despite_the_proxys_hint(run: dict[str, Any], stream: bool) -> None:
    """`x-request-disconnect-disabled: ?1` tells Serve's proxy to keep an abandoned request generating (issue 50's
    probe: queue depth 4 for 8-14 s after the clients left); the proxy's middleware drops the header, so the
    request ends with its connection, long before its last token, streamed or not."""
    router = serve.get_app_handle(APP)
    longest = router.info.remote().result()["context_window"] - 4  # every token the window allows
    body = json.dumps(
        {"model": MODEL_NAME, "prompt": [7, 8, 9, 10], "max_tokens": longest, "ignore_eos": True, "stream": stream}
    ).encode()
    host, port = urllib.parse.urlsplit(run["url"]).hostname, urllib.parse.urlsplit(run["url"]).port
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"x-request-disconnect-disabled: ?1\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    router.stats.remote(reset=True).result()  # its rounds alone from here
    with socket.create_connection((host, port), timeout=30) as client:
        client.sendall(head + body)
        assert wait_until(lambda: router.stats.remote().result()["active"] == 1, 30, every_s=0.1), "generating"
        time.sleep(0.5)
    # the client is gone: the router lets go of the request (kept generating, it ends at its last token)
    assert wait_until(lambda: router.stats.remote().result()["active"] == 0, 120, every_s=0.2)
    generated = router.stats.remote().result()["tokens"]
    assert generated < longest // 2, f"the abandoned request went on generating: {generated} of {longest} tokens"
