"""The local run's Prometheus endpoint, scraped: Ray started as `make run` starts it (deploy/local/demo.py,
with its metrics export port), the application of tiny models deployed as `make run` deploys it (its draft and
target pools autoscaled on busy time, so each reports it), real requests. After one greedy request the
endpoint's counters are the request's own, under vLLM's names and specserve's. Then the endpoint is scraped
every few seconds, as Prometheus would, across a second batch of requests through the OpenAI API (a completion,
a request refused with 429 while another streams, one refused with 400, a client that leaves): every query of
Ray Serve LLM's vLLM dashboard (tests/fixtures/ray_serve_llm_panels.json, the panels whose metrics specserve
records) and of specserve's dashboard returns a finite value on those scrapes (tests/promql.py), with the
template variables at All and at this application and model, and vLLM's acceptance-length query equals the
completion's own mean acceptance length. On the same run, through Serve's proxy as `make run` installs it: a
client that leaves mid-stream stops its request's generation, `x-request-disconnect-disabled` or not."""

from __future__ import annotations

import json
import math
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import ray
from ray import serve

from deploy.front.proxy_guard import PROXY_CALLBACK, PROXY_CALLBACK_ENV
from deploy.local.demo import deploy_local, start_local_ray
from tests import ray_llm_panels
from tests.actors.serve_helpers import APP, REPO, free_port, merged, small_cpu_args, wait_until
from tests.front_router import MODEL_NAME, save_tiny_pair
from tests.prometheus import Sample, grafana, panel_queries, regex_value, samples, total
from tests.promql import Prometheus, Vector

pytestmark = pytest.mark.slow
MAX_NEW = 24
# Autoscaled on busy time, so each draft and target replica reports its busy fraction; at a target of 1.0 one
# replica is always enough (a replica's fraction is at most 1): the pools stay at one replica.
BUSY = {"min_replicas": 1, "max_replicas": 2, "signal": "busy", "target_busy": 1.0}
ARGS = {
    "speculation": {"load_adaptive": False},  # the tiny draft costs as much as the tiny target: it would stop drafting
    "front_door": {"per_request_spec_decode_metrics": True},
    "router_pool": {"router": {"max_active_sequences": 1}},  # a second request while one streams: HTTP 429
    "draft_pool": {"autoscaling": BUSY},
    "target_pool": {"autoscaling": BUSY},
}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One greedy request on the local run: its usage and the metrics URL."""
    target, draft, _ = save_tiny_pair(tmp_path_factory.mktemp("metrics"))
    args = merged(small_cpu_args(target, draft, MODEL_NAME), ARGS)
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


def scrape(url: str) -> list[Sample]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return samples(r.read().decode())


def scrape_until(
    url: str, done: Any, timeout_s: float = 60, kept: list[tuple[float, list[Sample]]] | None = None
) -> list[Sample]:
    """Scrapes every 2 s until `done(samples)` (Ray's workers report to the agent every few seconds); each scrape
    with its time goes to `kept`."""
    deadline = time.monotonic() + timeout_s
    while True:
        scraped = scrape(url)
        if kept is not None:
            kept.append((time.time(), scraped))
        if done(scraped) or time.monotonic() > deadline:
            return scraped
        time.sleep(2)


def counted(usage: dict[str, Any]) -> dict[str, float]:
    """What the endpoint's counters must read after the one request."""
    spec = {
        "num_drafts_total": usage["drafts"],
        "num_draft_tokens_total": usage["drafted"],
        "num_accepted_tokens_total": usage["accepted"],
        "num_accepted_tokens_per_pos_total": usage["accepted"],
    }
    return {
        **{f"ray_spec_decode_{name}": n for name, n in spec.items()},
        **{f"ray_vllm_spec_decode_{name}": n for name, n in spec.items()},
        "ray_specserve_generated_tokens_total": usage["completion_tokens"],
        "ray_vllm_generation_tokens_total": usage["completion_tokens"],
        "ray_vllm_prompt_tokens_total": usage["prompt_tokens"],
        "ray_vllm_request_success_total": 1,
    }


def test_counters_at_the_endpoint_are_the_requests_own(run: dict[str, Any]) -> None:
    usage, want = run["usage"], counted(run["usage"])
    assert usage["completion_tokens"] == MAX_NEW and usage["drafts"] > 0 and usage["accepted"] > 0, usage
    scraped = scrape_until(run["metrics"], lambda s: all(total(s, n) == v for n, v in want.items()))
    assert {n: total(scraped, n) for n in want} == want
    assert total(scraped, "ray_vllm_request_success_total", finished_reason="length", model_name=MODEL_NAME) == 1
    per_pos = {s.labels["position"] for s in scraped if s.name == "ray_spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {str(p) for p in range(len(per_pos))}  # 0-based, contiguous
    for position in per_pos:  # vLLM's position p is our depth p + 1
        ours = total(scraped, "ray_specserve_accepted_tokens_total", position=str(int(position) + 1))
        assert ours == total(scraped, "ray_spec_decode_num_accepted_tokens_per_pos_total", position=position)


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """A completion through the OpenAI API: its HTTP status and JSON body."""
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@contextmanager
def streaming(url: str, body: dict[str, Any]) -> Iterator[None]:
    """A streamed completion, running while the block runs; its client leaves at the end."""
    data = json.dumps(body | {"stream": True}).encode()
    host, port = urllib.parse.urlsplit(url).hostname, urllib.parse.urlsplit(url).port
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    router = serve.get_app_handle(APP)
    with socket.create_connection((host, port), timeout=30) as client:
        client.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
        assert wait_until(lambda: router.stats.remote().result()["active"] == 1, 30, every_s=0.1), "streaming"
        yield
    assert wait_until(lambda: router.stats.remote().result()["active"] == 0, 120, every_s=0.2), "the client left"


def refusals(url: str) -> None:
    """A request refused with 429 (another streams: max_active_sequences 1), one with 400, a client that leaves."""
    longest = serve.get_app_handle(APP).info.remote().result()["context_window"] - 3  # all the window allows
    held = {"model": MODEL_NAME, "prompt": [7, 8, 9], "max_tokens": longest, "ignore_eos": True, "max_draft_tokens": 0}
    with streaming(url, held):  # plain decoding: no draft counted but the completion's
        assert post(url, {"model": MODEL_NAME, "prompt": [7, 8], "max_tokens": 4})[0] == 429
    assert post(url, {"model": MODEL_NAME, "prompt": [7, 8], "max_tokens": 10**7})[0] == 400


def counts(drafts: int, refused: int) -> Any:
    """Whether a scrape shows `drafts` draft rounds, `refused` refusals (429) and as many clients gone, and the
    busy fraction of both pools."""

    def shown(scraped: list[Sample]) -> bool:
        pools = {x.labels.get("deployment") for x in scraped if x.name == "ray_specserve_busy_fraction"}
        aborted = total(scraped, "ray_vllm_request_success_total", finished_reason="abort")
        rejected = total(scraped, "ray_specserve_requests_rejected_total")
        drafted = total(scraped, "ray_vllm_spec_decode_num_drafts_total")
        return pools == {"draft", "target"} and aborted == rejected == refused and drafted == drafts

    return shown


@pytest.fixture(scope="module")
def window(run: dict[str, Any]) -> dict[str, Any]:
    """Scrapes every 2 s from before the second batch of requests to after it: a Prometheus of them, the time its
    queries are evaluated at, and the batch's completion's speculative-decoding summary. (It adds to the counters:
    test_counters_at_the_endpoint_are_the_requests_own runs before it.)"""
    url, drafts = run["metrics"], run["usage"]["drafts"]
    refusals(run["url"])  # once before the window, so their series are there to rise in it
    kept: list[tuple[float, list[Sample]]] = []
    assert counts(drafts, 1)(scrape_until(url, counts(drafts, 1), kept=kept)), "the first counts never came"
    del kept[:-1]  # the window starts here
    body = {"model": MODEL_NAME, "prompt": [12, 13, 14, 15, 12, 13], "max_tokens": MAX_NEW, "temperature": 0.0}
    status, completion = post(run["url"], body | {"ignore_eos": True})
    assert status == 200, completion
    refusals(run["url"])
    spec = completion["metrics"]["speculative_decoding"]
    done = counts(drafts + spec["num_spec_steps"], 2)
    assert done(scrape_until(url, done, kept=kept)), "the batch's counts never reached the endpoint"
    at = math.ceil(kept[-1][0] / 60) * 60  # a whole minute, as a dashboard refreshed then: a subquery steps on them
    assert at - kept[0][0] < 240, "the window must fit the dashboards' 5-minute ranges"
    return {"prometheus": Prometheus(kept), "at": at, "spec": spec}


def finite(prometheus: Prometheus, expr: str, at: float) -> list[float]:
    result = prometheus.query(expr, at)
    found = [v for _, v in result.samples] if isinstance(result, Vector) else [result]
    return [v for v in found if math.isfinite(v)]


def unanswered(window: dict[str, Any], exprs: dict[str, list[str]], variables: dict[str, str]) -> list[str]:
    """The queries (by panel) that return no finite value on the window's scrapes."""
    prometheus, at = window["prometheus"], window["at"]
    return [
        f"{title}: {e}" for title, es in exprs.items() for e in es if not finite(prometheus, grafana(e, variables), at)
    ]


def test_ray_serve_llms_vllm_panels_show_values(window: dict[str, Any]) -> None:
    """Ray's dashboard as it opens (every variable All) and filtered to this model: the panels reading vLLM's
    metrics show it; "Requests / s" reads Serve's counter alone, which has no model_name (as for vLLM)."""
    fixture = ray_llm_panels.load()
    served = {p["title"]: p["exprs"] for p in fixture["panels"] if ray_llm_panels.served(p)}
    assert unanswered(window, served, fixture["variables"]) == []
    vllm = {title: exprs for title, exprs in served.items() if any("ray_vllm_" in e for e in exprs)}
    assert len(vllm) == len(served) - 1
    model = fixture["variables"] | {"vllm_model_name": regex_value(MODEL_NAME), "deployment": "router|target"}
    assert unanswered(window, vllm, model) == []


def test_specserve_dashboard_shows_values(window: dict[str, Any]) -> None:
    for application, model in ((".*", ".*"), (regex_value(APP), regex_value(MODEL_NAME))):
        variables = {"application": application, "model": model, "__rate_interval": "5m"}
        assert unanswered(window, panel_queries(), variables) == [], (application, model)
    other = {"application": ".*", "model": "other", "__rate_interval": "5m"}
    (busy,) = panel_queries()["Busy (autoscaling signal)"]
    assert not finite(window["prometheus"], grafana(busy, other), window["at"])  # the model filter filters
    result = window["prometheus"].query(grafana(busy, other | {"model": ".*"}), window["at"])
    assert isinstance(result, Vector) and {labels["deployment"] for labels, _ in result.samples} == {"draft", "target"}


def test_vllm_acceptance_length_is_the_completions(window: dict[str, Any]) -> None:
    """Over the window only the completion drafted (the other requests decoded plainly or were refused)."""
    (query,) = panel_queries()["Acceptance length"]
    variables = {"application": ".*", "model": regex_value(MODEL_NAME), "__rate_interval": "5m"}
    (length,) = finite(window["prometheus"], grafana(query, variables), window["at"])
    spec = window["spec"]
    assert spec["num_spec_steps"] > 0 and spec["mean_acceptance_length"] > 1, spec
    assert length == pytest.approx(spec["mean_acceptance_length"])
    assert length == pytest.approx(1 + spec["num_accepted_draft_tokens"] / spec["num_spec_steps"])


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
