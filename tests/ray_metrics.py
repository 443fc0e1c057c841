"""A stand-in for `ray.serve.metrics` in plain-Python tests: it keeps every metric made, with what was recorded in
it by tags (each object's default tags merged in), so a test reads what `actors/metrics.py` would have exported."""

from __future__ import annotations

from collections import Counter

import pytest

import actors.metrics


class Recorder:
    """One metric object; objects of one name share their values (Ray's series are per name and tags)."""

    def __init__(
        self, kind: str, name: str, tag_keys: tuple[str, ...], values: Counter[tuple[tuple[str, str], ...]]
    ) -> None:
        self.kind, self.name, self.tag_keys, self.values = kind, name, tag_keys, values
        self.default: dict[str, str] = {}

    def set_default_tags(self, default_tags: dict[str, str]) -> Recorder:
        if "deployment" in default_tags:  # as Serve, which adds its tags to the dict it is given
            raise ValueError("'deployment' tag is reserved for Ray Serve metrics")
        if set(default_tags) - set(self.tag_keys):  # as Ray
            raise ValueError(f"{self.name}: default tags {sorted(default_tags)}, declared {sorted(self.tag_keys)}")
        self.default = dict(default_tags)
        default_tags["deployment"] = "(Serve's)"
        return self

    def _key(self, tags: dict[str, str] | None) -> tuple[tuple[str, str], ...]:
        tags = self.default | (tags or {})
        if set(tags) != set(self.tag_keys):  # Ray fails a record missing a declared tag (here an undeclared one too)
            raise ValueError(f"{self.name}: tags {sorted(tags)}, declared {sorted(self.tag_keys)}")
        return tuple(sorted(tags.items()))

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        """A counter's increment or a histogram's observation: kept as their sum."""
        self.values[self._key(tags)] += value

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        if value <= 0:  # as Ray's Counter.inc, which fails the caller
            raise ValueError(f"value must be >0, got {value}")
        self.observe(value, tags)

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        """A gauge's value: the last one set."""
        self.values[self._key(tags)] = value

    @property
    def total(self) -> float:
        return sum(self.values.values())

    def by(self, tag: str) -> dict[str, float]:
        return {dict(key)[tag]: value for key, value in self.values.items()}


class FakeRayMetrics:
    """`ray.serve.metrics`' three constructors (Ray's names and signatures)."""

    def __init__(self) -> None:
        self.made: dict[str, Recorder] = {}

    def _make(self, kind: str, name: str, tag_keys: tuple[str, ...] | None) -> Recorder:
        """A new metric object; `made` keeps the first of each name (all of a name record into its values)."""
        if name not in self.made:
            self.made[name] = Recorder(kind, name, tag_keys or (), Counter())
            return self.made[name]
        first = self.made[name]
        if (first.kind, first.tag_keys) != (kind, tag_keys or ()):
            raise ValueError(f"{name}: declared as {first.kind} {first.tag_keys}, now {kind} {tag_keys}")
        return Recorder(kind, name, tag_keys or (), first.values)

    def Counter(self, name: str, description: str = "", tag_keys: tuple[str, ...] | None = None) -> Recorder:
        return self._make("counter", name, tag_keys)

    def Gauge(self, name: str, description: str = "", tag_keys: tuple[str, ...] | None = None) -> Recorder:
        return self._make("gauge", name, tag_keys)

    def Histogram(
        self,
        name: str,
        description: str = "",
        boundaries: list[float] | None = None,
        tag_keys: tuple[str, ...] | None = None,
    ) -> Recorder:
        return self._make("histogram", name, tag_keys)


def fake_ray_metrics(monkeypatch: pytest.MonkeyPatch) -> FakeRayMetrics:
    """`actors.metrics` records into a fake from now on (as inside a Ray worker)."""
    fake = FakeRayMetrics()
    monkeypatch.setattr(actors.metrics, "_ray_metrics", lambda: fake)
    return fake
