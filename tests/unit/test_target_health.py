"""A target replica's health is checked, not assumed: its shards are pinged with a deadline.

A shard that died while no request ran (SIGKILL from outside Ray), or one that does not answer,
makes `check_health` (Serve's hook) and `ping` (the front doors' readiness) fail; healthy shards
pass both. Fake shards in this process; tests/reliability/test_limits_and_leaks.py kills a real
shard process under Serve.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import ray

from actors import target_replica
from actors.config import ModelConfig, TargetConfig
from actors.target_replica import TargetReplica

CONFIG = TargetConfig(model=ModelConfig(path="unused", dtype="float32"))


class FakeShards:
    """Shards whose ping answers, raises as a dead actor's call does, or never returns."""

    def __init__(self, ping: str = "answers") -> None:
        self.ping, self.calls = ping, 0

    async def call(self, method: str, *args: Any) -> list[Any]:
        assert method == "ping", method
        self.calls += 1
        if self.ping == "dead":
            raise ray.exceptions.RayActorError()
        if self.ping == "hung":
            await asyncio.sleep(3600)
        return [0]


def test_healthy_shards_pass_and_are_pinged() -> None:
    shards = FakeShards()
    replica = TargetReplica(CONFIG, shards=shards)
    asyncio.run(replica.check_health())
    assert asyncio.run(replica.ping()) == replica.tag
    assert shards.calls == 2, "each check pings the shards"


def test_a_shard_that_died_with_no_request_in_flight_fails_the_checks() -> None:
    replica = TargetReplica(CONFIG, shards=FakeShards("dead"))
    for check in (replica.check_health, replica.ping):
        with pytest.raises(RuntimeError, match="a target shard failed"):
            asyncio.run(check())


def test_a_shard_that_does_not_answer_fails_the_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(target_replica, "SHARD_PING_TIMEOUT_S", 0.2)
    replica = TargetReplica(CONFIG, shards=FakeShards("hung"))
    with pytest.raises(RuntimeError, match="did not answer a ping"):
        asyncio.run(replica.check_health())
