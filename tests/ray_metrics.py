"""A stand-in for `ray.serve.metrics` in plain-Python tests: it keeps every recorder made, with what
was recorded in it by tags, so a test reads what `actors/metrics.py` would have exported."""

from __future__ import annotations

from collections import Counter

import pytest

import actors.metrics


class Recorder:
    def __init__(self, kind: str, name: str) -> None:
        self.kind, self.name = kind, name
        self.values: Counter[tuple[tuple[str, str], ...]] = Counter()

    def record(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.values[tuple(sorted((tags or {}).items()))] += value

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        if value <= 0:  # as Ray's Counter.inc, which fails the caller
            raise ValueError(f"value must be >0, got {value}")
        self.record(value, tags)

    set = observe = record

    @property
    def total(self) -> float:
        return sum(self.values.values())

    def by(self, tag: str) -> dict[str, float]:
        return {dict(key)[tag]: value for key, value in self.values.items()}


class FakeRayMetrics:
    """`ray.serve.metrics`' three constructors (Ray's names and signatures)."""

    def __init__(self) -> None:
        self.made: dict[str, Recorder] = {}

    def _make(self, kind: str, name: str) -> Recorder:
        self.made[name] = Recorder(kind, name)
        return self.made[name]

    def Counter(self, name: str, doc: str, tags: tuple[str, ...] = ()) -> Recorder:
        return self._make("counter", name)

    def Gauge(self, name: str, doc: str) -> Recorder:
        return self._make("gauge", name)

    def Histogram(self, name: str, doc: str, boundaries: list[float]) -> Recorder:
        return self._make("histogram", name)


def fake_ray_metrics(monkeypatch: pytest.MonkeyPatch) -> FakeRayMetrics:
    """`actors.metrics` records into a fake from now on (as inside a Ray worker)."""
    fake = FakeRayMetrics()
    monkeypatch.setattr(actors.metrics, "_ray_metrics", lambda: fake)
    return fake
