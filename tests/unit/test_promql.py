"""tests/promql.py against Prometheus' own arithmetic: rate's extrapolation by hand, Ray Serve LLM's WorkerId join
(`group_left`) and NaN guard (`and on(...) (... > 0)`), histogram_quantile's interpolation, a subquery's steps on
whole minutes, regex matchers on absent labels, precedence, and the mistakes Prometheus refuses."""

from __future__ import annotations

import math

import pytest

from tests.prometheus import Sample, grafana, regex_value
from tests.promql import Prometheus, Vector
from tests.promql_parse import ParseError, parse


def scrape(**series: float) -> list[Sample]:
    """`name__label_value=v` keyword arguments as samples (labels in the name after `__`, `_` for `=`)."""
    out = []
    for key, value in series.items():
        name, *pairs = key.split("__")
        out.append(Sample(name, dict(p.split("_", 1) for p in pairs), value))
    return out


def values(result: float | Vector) -> dict[tuple[tuple[str, str], ...], float]:
    assert isinstance(result, Vector)
    return {tuple(sorted(labels.items())): v for labels, v in result.samples}


def test_rate_extrapolates_as_prometheus_does() -> None:
    # samples at 10, 20, 30 s; range (−30, 30]: the first lies 40 s from the range's start, more than 1.1
    # average intervals (11 s), so the increase extends half an interval (5 s) before it, and 0 s after the last
    prom = Prometheus([(10.0, scrape(c=100)), (20.0, scrape(c=110)), (30.0, scrape(c=120))])
    assert values(prom.query("increase(c[60s])", 30.0)) == {(): pytest.approx(20 * 25 / 20)}
    assert values(prom.query("rate(c[1m])", 30.0)) == {(): pytest.approx(25 / 60)}
    # a counter from 0 extrapolates no further back than its zero
    zero = Prometheus([(10.0, scrape(c=0)), (20.0, scrape(c=10)), (30.0, scrape(c=20))])
    assert values(zero.query("increase(c[1m])", 30.0)) == {(): pytest.approx(20.0)}
    assert values(zero.query("delta(c[1m])", 30.0)) == {(): pytest.approx(25.0)}  # delta: no counter logic
    assert values(prom.query("rate(c[5s])", 30.0)) == {}  # one sample in range: no rate


def test_ray_serve_llms_worker_join_and_guard() -> None:
    """Its panels' shape: a per-WorkerId ratio, kept where the denominator moved, given deployment and replica
    by a constant-1 lookup on Serve's counter."""
    before = scrape(x__WorkerId_a=0, x__WorkerId_b=0, n__WorkerId_a=0, n__WorkerId_b=5)
    before += [Sample("serve", {"WorkerId": "a", "deployment": "router", "replica": "r1", "route": "/"}, 1)]
    before += [Sample("serve", {"WorkerId": "a", "deployment": "router", "replica": "r1", "route": "/v1"}, 1)]
    after = scrape(x__WorkerId_a=6, x__WorkerId_b=0, n__WorkerId_a=3, n__WorkerId_b=5)
    after += [Sample(s.name, s.labels, 2) for s in before if s.name == "serve"]
    prom = Prometheus([(0.0, before), (10.0, after)])
    expr = (
        "((sum by(WorkerId) (rate(x[1m])) / sum by(WorkerId) (rate(n[1m])))"
        " and on(WorkerId) (sum by(WorkerId) (rate(n[1m])) > 0))"
        " * on(WorkerId) group_left(deployment, replica)"
        ' max by(WorkerId, deployment, replica) (serve{deployment=~".*"} * 0 + 1)'
    )
    assert values(prom.query(expr, 10.0)) == {(("WorkerId", "a"), ("deployment", "router"), ("replica", "r1")): 2.0}


def test_histogram_quantile_interpolates_within_the_bucket() -> None:
    buckets = {"h_bucket__le_1.0": 2, "h_bucket__le_2.0": 4, "h_bucket__le_+Inf": 4}
    prom = Prometheus([(0.0, scrape(**buckets))])
    assert values(prom.query("histogram_quantile(0.5, h_bucket)", 0.0)) == {(): 1.0}
    assert values(prom.query("histogram_quantile(0.75, sum by (le) (h_bucket))", 0.0)) == {(): 1.5}
    empty = Prometheus([(0.0, scrape(**{k: 0 for k in buckets}))])
    assert math.isnan(values(empty.query("histogram_quantile(0.5, h_bucket)", 0.0))[()])


def test_a_subquery_steps_on_whole_minutes() -> None:
    # samples at 100 and 130 s: at the step 120 the [2m] rate has one sample; at 180 both, the increase of 60
    # extended back to the counter's zero (0 s) and half an interval (15 s) past 130: 60 x 45 / 30 over 120 s
    prom = Prometheus([(100.0, scrape(c=0)), (130.0, scrape(c=60))])
    assert values(prom.query("max_over_time(sum(rate(c[2m]))[5m:1m])", 180.0)) == {(): pytest.approx(0.75)}
    assert values(prom.query("max_over_time(sum(rate(c[2m]))[5m:1m])", 170.0)) == {}  # steps 120, no 180


def test_matchers_read_an_absent_label_as_empty() -> None:
    prom = Prometheus([(0.0, scrape(m=1, m__model_x=2))])
    assert values(prom.query('sum(m{model=~".*", cluster=~".*"})', 0.0)) == {(): 3.0}
    assert values(prom.query('m{model=~"x"}', 0.0)) == {(("__name__", "m"), ("model", "x")): 2.0}
    assert values(prom.query('m{model!="x"}', 0.0)) == {(("__name__", "m"),): 1.0}
    assert values(prom.query("m", 400.0)) == {}  # older than the 5 minutes an instant selector looks back


def test_precedence_and_scalars() -> None:
    prom = Prometheus([(0.0, scrape(a=2, b=0))])
    assert prom.query("1 + 2 * 3 ^ 2", 0.0) == 19.0
    assert prom.query("2 ^ 3 ^ 2", 0.0) == 512.0
    assert values(prom.query("-a + 1", 0.0)) == {(): -1.0}
    assert values(prom.query("a / scalar(b)", 0.0)) == {(): math.inf}
    assert values(prom.query("a > 1", 0.0)) == {(("__name__", "a"),): 2.0}  # a filter keeps the name
    assert values(prom.query("a > bool 3", 0.0)) == {(): 0.0}


def test_what_prometheus_refuses_is_refused() -> None:
    prom = Prometheus([(0.0, scrape(x__w_1=1, x__w_2=1, y=1))])
    with pytest.raises(ValueError, match="one-to-one"):
        prom.query("x * on() y", 0.0)  # two left series match one right: group_left wanted
    with pytest.raises(ValueError, match="many-to-many"):
        prom.query("y * on() group_left x", 0.0)
    with pytest.raises(ParseError):
        parse("x offset 5m")


def test_grafana_variables() -> None:
    expr = 'rate(m{model_name=~"$model", app=~"${app}"}[$__rate_interval])'
    assert grafana(expr, {"model": regex_value("a.b"), "app": ".*", "__rate_interval": "5m"}) == (
        'rate(m{model_name=~"a\\\\.b", app=~".*"}[5m])'
    )
    prom = Prometheus([(0.0, [Sample("m", {"model_name": "a.b"}, 1), Sample("m", {"model_name": "axb"}, 1)])])
    assert len(values(prom.query(grafana('m{model_name=~"$m"}', {"m": regex_value("a.b")}), 0.0))) == 1
    with pytest.raises(KeyError, match="interval"):
        grafana("x[$interval]", {})
