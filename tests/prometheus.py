"""Prometheus for the metrics tests: a scrape's samples, the metric names a PromQL query reads, the
names Ray exports a metric under, the Grafana dashboard's queries and its template variables' values
(tests/promql.py evaluates the queries).

Ray 2.60's metrics agent prefixes every application metric with `ray_` and gives a counter the
suffix `_total` when its name lacks one (`spec_decode_num_drafts` -> `ray_spec_decode_num_drafts_total`,
`specserve_requests_total` -> `ray_specserve_requests_total`); a histogram `h` shows as `ray_h_bucket`,
`ray_h_sum` and `ray_h_count`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from deploy.k8s import DASHBOARD

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_NAME = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")
_SET_ASIDE = re.compile(
    r"\{[^}]*\}"  # label matchers
    r"|\[[^\]]*\]"  # ranges
    r"|\boffset\s+\w+"  # offsets
    r"|\b(by|without|on|ignoring)\s*\([^)]*\)"  # grouping labels
    r"|\b(group_left|group_right)\s*(\([^)]*\))?"
)
_OPERATORS = {"and", "or", "unless", "bool"}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def samples(text: str) -> list[Sample]:
    """Every sample line of Prometheus' text format."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, value = line.rsplit(" ", 1)
        name, _, labels = head.partition("{")
        out.append(Sample(name, dict(_LABEL.findall(labels)), float(value)))
    return out


def total(scraped: list[Sample], name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels` (every replica, worker and node)."""
    return sum(s.value for s in scraped if s.name == name and labels.items() <= s.labels.items())


def query_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label matchers, ranges and grouping labels set aside)."""
    bare = _SET_ASIDE.sub(" ", expr)
    return {m[1] for m in _NAME.finditer(bare) if not m[2] and m[1] not in _OPERATORS}


def exported(kind: str, name: str) -> set[str]:
    """The names Ray's Prometheus endpoint shows for an application metric of this kind."""
    base = "ray_" + name
    if kind == "counter":
        return {base if base.endswith("_total") else base + "_total"}
    if kind == "histogram":
        return {base + "_bucket", base + "_sum", base + "_count"}
    return {base}


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def panel_queries() -> dict[str, list[str]]:
    """Each dashboard panel's title -> its PromQL expressions."""
    return {p["title"]: [t["expr"] for t in p["targets"]] for p in dashboard()["panels"]}


def grafana(expr: str, variables: dict[str, str]) -> str:
    """`expr` with Grafana's template variables (`$name`, `${name}`) replaced by their values."""

    def value(m: re.Match[str]) -> str:
        name = m[1] or m[2]
        if name not in variables:
            raise KeyError(f"template variable ${name} has no value: {expr}")
        return variables[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)


def regex_value(text: str) -> str:
    """A value as Grafana writes it into a regex matcher: regex characters escaped (twice: in a PromQL string)."""
    return re.sub(r"[\\^$*+?.()|{}\[\]]", lambda m: "\\\\" + m[0], text)
