"""Prometheus for the metrics tests: a scrape's samples, the metric names a PromQL query reads, the
names Ray exports a metric under, and the Grafana dashboard's queries.

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


def evaluate_on_totals(expr: str, scraped: list[Sample]) -> float:
    """A ratio query of `sum(rate(counter[...]))` terms, each read as the counter's total: over a window
    holding a whole run from Ray's start (counters from 0), each rate is its total over the same span,
    so the query equals the totals' arithmetic."""
    arithmetic = re.sub(
        r"sum\(rate\(([a-zA-Z_:][a-zA-Z0-9_:]*)\[[^\]]*\]\)\)", lambda m: repr(total(scraped, m[1])), expr
    )
    if not re.fullmatch(r"[0-9.e+\-*/() ]+", arithmetic):
        raise ValueError(f"not a ratio of sum(rate(...)) terms: {expr}")
    return float(eval(arithmetic))  # digits and + - * / ( ) only, checked above
