"""A small Prometheus for the metrics tests: scrapes of an endpoint stored as series, and PromQL queries evaluated
on them as Prometheus evaluates them (the subset tests/promql_parse.py reads).

Semantics kept from Prometheus: an instant selector reads each series' latest sample at most 5 minutes old; a
range `[r]` holds the samples in (t - r, t]; `rate`, `increase` and `delta` extrapolate as Prometheus'
`extrapolatedRate` does (to the range's ends when a sample lies within 1.1 average intervals of them, else half
an interval; a counter never back before zero); a subquery's steps fall on multiples of its step; arithmetic
drops the metric name; a comparison without `bool` filters; `and` / `or` / `unless` and one-to-one or
`group_left` / `group_right` matching on the signature of `on(...)`, `ignoring(...)` or every label; an absent
label reads as "". Scalars are floats, instant vectors `Vector`, range vectors `Matrix`.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.prometheus import Sample
from tests.promql_parse import Aggregate, Binary, Call, Neg, Num, Range, Selector, parse

LOOKBACK_S = 300.0
Labels = dict[str, str]
_COMPARISONS: dict[str, Callable[[float, float], bool]] = {
    "==": operator.eq, "!=": operator.ne, ">": operator.gt, "<": operator.lt, ">=": operator.ge, "<=": operator.le,
}  # fmt: skip


@dataclass
class Vector:
    samples: list[tuple[Labels, float]]


@dataclass
class Matrix:
    series: list[tuple[Labels, list[tuple[float, float]]]]


Value = float | Vector | Matrix


def _arith(op: str, a: float, b: float) -> float:
    if op in ("/", "%") and b == 0:
        return math.nan if a == 0 or math.isnan(a) or op == "%" else math.copysign(math.inf, a)
    funcs: dict[str, Callable[[float, float], float]] = {
        "+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv, "%": math.fmod, "^": math.pow,
    }  # fmt: skip
    return funcs[op](a, b)


def _key(labels: Labels) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


def _unnamed(labels: Labels) -> Labels:
    return {k: v for k, v in labels.items() if k != "__name__"}


def _matches(labels: Labels, matchers: tuple[tuple[str, str, str], ...]) -> bool:
    for label, op, value in matchers:
        have = labels.get(label, "")
        hit = have == value if op in ("=", "!=") else re.fullmatch(value, have) is not None
        if hit != (op in ("=", "=~")):
            return False
    return True


def extrapolated(points: list[tuple[float, float]], start: float, end: float, counter: bool) -> float | None:
    """Prometheus' `extrapolatedRate` before its division by the range: `increase` (counter) or `delta`."""
    if len(points) < 2:
        return None
    (t0, v0), (tn, vn) = points[0], points[-1]
    change = vn - v0
    if counter:  # a reset: the counter went on from zero
        change += sum(before for (_, before), (_, after) in itertools.pairwise(points) if after < before)
    sampled = tn - t0
    average = sampled / (len(points) - 1)
    to_start, to_end = t0 - start, end - tn
    if counter and change > 0 and v0 >= 0:
        to_start = min(to_start, sampled * v0 / change)
    threshold = average * 1.1
    extended = (
        sampled + (to_start if to_start < threshold else average / 2) + (to_end if to_end < threshold else average / 2)
    )
    return change * extended / sampled


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' `bucketQuantile` over (upper bound, cumulative count) pairs."""
    buckets = sorted(buckets)
    if q < 0 or q > 1:
        return -math.inf if q < 0 else math.inf
    if len(buckets) < 2 or buckets[-1][0] != math.inf or buckets[-1][1] == 0:
        return math.nan
    counts = [c for _, c in buckets]
    counts = [max(counts[: i + 1]) for i in range(len(counts))]  # made monotonic, as Prometheus does
    rank = q * counts[-1]
    b = bisect.bisect_left(counts, rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    if b == 0 and buckets[0][0] <= 0:
        return buckets[0][0]
    start, below = (buckets[b - 1][0], counts[b - 1]) if b > 0 else (0.0, 0.0)
    if counts[b] == below:  # q = 0 over an empty first bucket
        return start
    return start + (buckets[b][0] - start) * (rank - below) / (counts[b] - below)


class Prometheus:
    """Scrapes `(unix time, samples)` as series; `query(expr, at)` evaluates PromQL at a time."""

    def __init__(self, scrapes: list[tuple[float, list[Sample]]]) -> None:
        series: dict[tuple[tuple[str, str], ...], dict[float, float]] = {}
        for at, samples in scrapes:
            for s in samples:
                series.setdefault(_key({"__name__": s.name, **s.labels}), {})[at] = s.value
        self.by_name: dict[str, list[tuple[Labels, list[tuple[float, float]]]]] = {}
        for key, points in series.items():
            labels = dict(key)
            self.by_name.setdefault(labels["__name__"], []).append((labels, sorted(points.items())))

    def query(self, expr: str, at: float) -> float | Vector:
        value = self.eval(parse(expr), at)
        if isinstance(value, Matrix):
            raise ValueError(f"a range vector is no query result: {expr}")
        return value

    def eval(self, node: object, t: float) -> Value:
        if isinstance(node, Num):
            return node.value
        if isinstance(node, Neg):
            return self._binary(Binary("*", Num(-1.0), node.expr), t)
        if isinstance(node, Selector):
            return self._instant(node, t)
        if isinstance(node, Range):
            return self._range(node, t)
        if isinstance(node, Call):
            return self._call(node, t)
        if isinstance(node, Aggregate):
            return self._aggregate(node, t)
        if isinstance(node, Binary):
            return self._binary(node, t)
        raise TypeError(node)

    def _selected(self, sel: Selector) -> list[tuple[Labels, list[tuple[float, float]]]]:
        names = [sel.name] if sel.name else list(self.by_name)
        return [
            (labels, points)
            for n in names
            for labels, points in self.by_name.get(n, [])
            if _matches(labels, sel.matchers)
        ]

    def _instant(self, sel: Selector, t: float) -> Vector:
        out = []
        for labels, points in self._selected(sel):
            i = bisect.bisect_right(points, (t, math.inf)) - 1
            if i >= 0 and points[i][0] > t - LOOKBACK_S:
                out.append((labels, points[i][1]))
        return Vector(out)

    def _range(self, node: Range, t: float) -> Matrix:
        start = t - node.seconds
        if node.step is None:  # a range selector
            if not isinstance(node.inner, Selector):
                raise TypeError("a range needs a selector; a subquery a step")
            return Matrix(
                [(labels, [p for p in points if start < p[0] <= t]) for labels, points in self._selected(node.inner)]
            )
        first = math.floor(start / node.step) * node.step + node.step  # the first multiple of the step after start
        series: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
        for k in range(int((t - first) // node.step) + 1):
            step_at = first + k * node.step
            inner = self.eval(node.inner, step_at)
            for labels, value in inner.samples if isinstance(inner, Vector) else []:
                series.setdefault(_key(labels), []).append((step_at, value))
        return Matrix([(dict(key), points) for key, points in series.items()])

    def _call(self, node: Call, t: float) -> Value:
        args = [self.eval(a, t) for a in node.args]
        if node.func in ("rate", "increase", "delta", "irate"):
            (m,) = args
            assert isinstance(m, Matrix) and isinstance(node.args[0], Range)
            return Vector(_changes(node.func, m, t - node.args[0].seconds, t))
        if node.func.endswith("_over_time"):
            (m,) = args
            assert isinstance(m, Matrix)
            return Vector(_over_time(node.func, m))
        return _scalar_functions(node.func, args)

    def _aggregate(self, node: Aggregate, t: float) -> Vector:
        inner = self.eval(node.expr, t)
        assert isinstance(inner, Vector), node
        groups: dict[tuple[tuple[str, str], ...], list[float]] = {}
        for labels, value in inner.samples:
            groups.setdefault(_key(_grouped(labels, node)), []).append(value)
        reduce: dict[str, Callable[[list[float]], float]] = {
            "sum": math.fsum, "avg": lambda v: math.fsum(v) / len(v), "max": max, "min": min, "count": len,
        }  # fmt: skip
        return Vector([(dict(key), float(reduce[node.op](values))) for key, values in groups.items()])

    def _binary(self, node: Binary, t: float) -> Value:
        lhs, rhs = self.eval(node.lhs, t), self.eval(node.rhs, t)
        if isinstance(lhs, Matrix) or isinstance(rhs, Matrix):
            raise TypeError("a binary operator over a range vector")
        if isinstance(lhs, Vector) and isinstance(rhs, Vector):
            return _vector_vector(node, lhs, rhs)
        if isinstance(lhs, Vector) or isinstance(rhs, Vector):
            return _vector_scalar(node, lhs, rhs)
        if node.op in _COMPARISONS:
            return float(_COMPARISONS[node.op](lhs, rhs))
        return _arith(node.op, lhs, rhs)


def _grouped(labels: Labels, node: Aggregate) -> Labels:
    if node.labels is None:
        return {}
    if node.without:
        return {k: v for k, v in _unnamed(labels).items() if k not in node.labels}
    return {k: labels[k] for k in node.labels if k in labels}


def _changes(func: str, m: Matrix, start: float, end: float) -> list[tuple[Labels, float]]:
    out = []
    for labels, points in m.series:
        if func == "irate":
            value = _irate(points)
        else:
            change = extrapolated(points, start, end, counter=func != "delta")
            value = None if change is None else change / (end - start) if func == "rate" else change
        if value is not None:
            out.append((_unnamed(labels), value))
    return out


def _irate(points: list[tuple[float, float]]) -> float | None:
    if len(points) < 2:
        return None
    (t0, v0), (t1, v1) = points[-2:]
    return (v1 - v0 if v1 >= v0 else v1) / (t1 - t0)


def _over_time(func: str, m: Matrix) -> list[tuple[Labels, float]]:
    reduce: dict[str, Callable[[list[float]], float]] = {
        "max_over_time": max, "min_over_time": min, "sum_over_time": math.fsum,
        "avg_over_time": lambda v: math.fsum(v) / len(v), "count_over_time": len,
    }  # fmt: skip
    return [(_unnamed(labels), float(reduce[func]([v for _, v in points]))) for labels, points in m.series if points]


def _scalar_functions(func: str, args: list[Value]) -> Value:
    if func == "histogram_quantile":
        q, vector = args
        assert isinstance(q, float) and isinstance(vector, Vector)
        return _histogram_quantile(q, vector)
    if func == "scalar":
        (vector,) = args
        assert isinstance(vector, Vector)
        return vector.samples[0][1] if len(vector.samples) == 1 else math.nan
    if func == "vector":
        (value,) = args
        assert isinstance(value, float)
        return Vector([({}, value)])
    if func in ("clamp_min", "clamp_max", "abs"):
        vector, *bound = args
        assert isinstance(vector, Vector)
        fn: Callable[[float], float] = {
            "clamp_min": lambda v: max(v, float(bound[0])),  # type: ignore[arg-type]
            "clamp_max": lambda v: min(v, float(bound[0])),  # type: ignore[arg-type]
            "abs": abs,
        }[func]
        return Vector([(_unnamed(labels), fn(v)) for labels, v in vector.samples])
    raise NotImplementedError(f"PromQL function {func}")


def _histogram_quantile(q: float, vector: Vector) -> Vector:
    groups: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
    for labels, value in vector.samples:
        if "le" in labels:
            rest = {k: v for k, v in _unnamed(labels).items() if k != "le"}
            groups.setdefault(_key(rest), []).append((float(labels["le"].replace("Inf", "inf")), value))
    return Vector([(dict(key), bucket_quantile(q, buckets)) for key, buckets in groups.items()])


def _signature(labels: Labels, node: Binary) -> tuple[tuple[str, str], ...]:
    if node.on is not None:
        return tuple((name, labels.get(name, "")) for name in sorted(node.on))
    dropped = {"__name__", *(node.ignoring or ())}
    return _key({k: v for k, v in labels.items() if k not in dropped})


def _vector_scalar(node: Binary, lhs: Any, rhs: Any) -> Vector:
    vector, left = (lhs, True) if isinstance(lhs, Vector) else (rhs, False)
    scalar = rhs if left else lhs
    out = []
    for labels, value in vector.samples:
        a, b = (value, scalar) if left else (scalar, value)
        if node.op not in _COMPARISONS:
            out.append((_unnamed(labels), _arith(node.op, a, b)))
        elif node.bool_:
            out.append((_unnamed(labels), float(_COMPARISONS[node.op](a, b))))
        elif _COMPARISONS[node.op](a, b):
            out.append((labels, value))
    return Vector(out)


def _vector_vector(node: Binary, lhs: Vector, rhs: Vector) -> Vector:
    if node.op in ("and", "unless", "or"):
        return _set_operation(node, lhs, rhs)
    many, one = (rhs, lhs) if node.group == "right" else (lhs, rhs)
    ones: dict[tuple[tuple[str, str], ...], tuple[Labels, float]] = {}
    for labels, value in one.samples:
        if ones.setdefault(_signature(labels, node), (labels, value)) != (labels, value):
            raise ValueError(f"many-to-many matching: several series on the one side match {labels}")
    if node.group is None and len({_signature(labels, node) for labels, _ in many.samples}) < len(many.samples):
        raise ValueError("one-to-one matching: several series match on the left (group_left wanted)")
    out = []
    for labels, value in many.samples:
        found = ones.get(_signature(labels, node))
        if found is None:
            continue
        a, b = (found[1], value) if node.group == "right" else (value, found[1])
        if node.op in _COMPARISONS and not node.bool_:
            if _COMPARISONS[node.op](a, b):
                out.append((_result_labels(labels, found[0], node), a))
            continue
        result = float(_COMPARISONS[node.op](a, b)) if node.op in _COMPARISONS else _arith(node.op, a, b)
        out.append((_unnamed(_result_labels(labels, found[0], node)), result))
    return Vector(out)


def _result_labels(many: Labels, one: Labels, node: Binary) -> Labels:
    """Prometheus' `resultMetric`: one-to-one keeps the `on` labels (drops the `ignoring` ones); group_left copies
    its labels from the one side."""
    out = dict(many)
    if node.group is None and node.on is not None:
        out = {k: v for k, v in out.items() if k in node.on}
    elif node.group is None and node.ignoring:
        out = {k: v for k, v in out.items() if k not in node.ignoring}
    for name in node.include:
        if name in one:
            out[name] = one[name]
        else:
            out.pop(name, None)
    return out


def _set_operation(node: Binary, lhs: Vector, rhs: Vector) -> Vector:
    right = {_signature(labels, node) for labels, _ in rhs.samples}
    if node.op == "and":
        return Vector([(labels, v) for labels, v in lhs.samples if _signature(labels, node) in right])
    if node.op == "unless":
        return Vector([(labels, v) for labels, v in lhs.samples if _signature(labels, node) not in right])
    left = {_signature(labels, node) for labels, _ in lhs.samples}
    return Vector(lhs.samples + [(labels, v) for labels, v in rhs.samples if _signature(labels, node) not in left])
