"""Replicas killed or hung mid-stream on local Ray: the client's stream completes with the target's own output.

- A draft replica `ray.kill`ed: the lane decodes without speculation (greedy output still equals
  the target alone), and speculates again once Serve has started a replacement.
- A target shard's process SIGKILLed: the replica's health check fails, Serve replaces it, the
  lane's verify retries land on the new replica, which re-prefills from the committed tokens the
  call carries; greedy output equals the target alone and a seeded sampled stream equals the same
  request served without the fault (randomness keyed by (seed, position)).
- A target shard's verify hung (its health thread still answering): past the forward's deadline the
  replica's health check fails, and the stream goes on on the replacement as for a kill.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from ray.serve.handle import DeploymentHandle

from actors.target_replica import SHARD_NAME
from deploy.config import AppConfig
from tests.actors.conftest import TinyPair, hf_greedy
from tests.actors.serve_helpers import deployed, local_ray, replicas, wait_until
from tests.reliability.conftest import describe, kill_replica, target_shard_killer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = [5, 17, 33, 60, 12, 9, 71]
LONG = 240  # tokens: the stream outlives the fault by far


@pytest.fixture(scope="module")
def app(tiny_pair: TinyPair) -> Iterator[DeploymentHandle]:
    config = AppConfig.model_validate(
        {
            "target_model": tiny_pair.target,
            "draft_model": tiny_pair.draft,
            "dtype": "float32",
            "torch_threads": 1,
            # The tiny draft costs as much as the tiny target: the load control would stop drafting,
            # and whether speculation resumes after the fault could not be seen.
            "speculation": {"load_adaptive": False},
            "draft_pool": {"num_cpus": 0.5},
            # a hung verify is found 3 s on (the tiny model's forwards take milliseconds)
            "target_pool": {"shard_num_cpus": 0.5, "health_check_period_s": 1.0, "verify_deadline_min_s": 3.0},
            "router_pool": {"num_cpus": 0.25, "router": {"draft_backoff_s": 0.5, "draft_timeout_s": 0.5}},
        }
    )
    with local_ray(num_cpus=4), deployed(config) as handle:
        yield handle


def params(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True} | extra


def stream_with_fault(handle: DeploymentHandle, sampling: dict[str, Any], fault: Callable[[], object]) -> list[dict]:
    """Stream one request; inject `fault` once the first chunk arrived (the sequence is mid-decode)."""

    async def run() -> list[dict]:
        gen = handle.options(stream=True).generate_stream.remote(PROMPT, sampling)
        chunks: list[dict] = []
        async for chunk in gen:  # type: ignore[union-attr]
            if not chunks:
                fault()
            chunks.append(chunk)
        return chunks

    return asyncio.run(run())


def tokens_of(chunks: list[dict]) -> list[int]:
    return [t for c in chunks for t in c["token_ids"]]


def replaced(deployment: str, old: str) -> bool:
    try:
        return replicas(deployment, ("RUNNING",)) == 1 and describe(deployment)["replica"] != old
    except Exception:  # the old replica still answers or is shutting down
        return False


def test_draft_replica_killed_mid_stream(app: DeploymentHandle, tiny_pair: TinyPair) -> None:
    app.stats.remote(reset=True).result()
    killed: list[str] = []
    chunks = stream_with_fault(app, params(LONG), lambda: killed.append(kill_replica("draft")))
    stats = app.stats.remote(reset=True).result()
    assert tokens_of(chunks) == hf_greedy(tiny_pair.target, PROMPT, LONG)
    assert chunks[-1]["finish_reason"] == "length"
    drafted_rounds = sum(stats["draft_calls"].values())
    print(f"rounds {stats['rounds']}, drafted {stats['draft_calls']}, usage {chunks[-1]['usage']}")
    assert stats["rounds"] - drafted_rounds >= 3, "some rounds ran without a draft (the draft pool was down)"

    assert wait_until(lambda: replaced("draft", killed[0]), timeout_s=120)
    again = app.generate.remote(PROMPT, params(40)).result()
    assert again["token_ids"] == hf_greedy(tiny_pair.target, PROMPT, 40)
    assert again["usage"]["drafted"] > 0, "speculation resumes on the replacement replica"


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled-seed"])
def test_target_shard_killed_mid_stream(app: DeploymentHandle, tiny_pair: TinyPair, sampled: bool) -> None:
    sampling = params(LONG, temperature=0.9, top_k=40, seed=1234) if sampled else params(LONG)
    if sampled:  # the same request without a fault: the stream must reproduce it token for token
        expected = app.generate.remote(PROMPT, sampling).result()["token_ids"]
    else:
        expected = hf_greedy(tiny_pair.target, PROMPT, LONG)
    app.stats.remote(reset=True).result()
    killed, kill = target_shard_killer()
    chunks = stream_with_fault(app, sampling, kill)
    stats = app.stats.remote(reset=True).result()
    print(f"verify calls by replica {stats['verify_calls']}, usage {chunks[-1]['usage']}")
    assert tokens_of(chunks) == expected
    assert chunks[-1]["finish_reason"] == "length"
    assert len(stats["verify_calls"]) == 2 and killed in stats["verify_calls"], "the stream moved replicas"
    assert wait_until(lambda: replaced("target", killed), timeout_s=60)


def test_a_hung_verify_replaces_its_replica_and_the_stream_completes(
    app: DeploymentHandle, tiny_pair: TinyPair
) -> None:
    """A verify forward that never returns (its shard's health thread still answering): past its deadline, sized
    to its tokens by the replica's measured cost (verify_deadline_min_s 3 here), the replica's health check
    fails and so does the readiness /health asks (503), Serve replaces the replica, and the stream goes on there
    with the target's own tokens within 60 s."""
    import ray

    def hang_verifies(shard: Any, seconds: float) -> None:
        """Inside the shard's process (`__ray_call__`; nested, so sent by value): every later verify forward sleeps
        first, as a forward that never returns would, while the shard's health thread keeps answering pings."""
        import time

        caches = shard._verifiers
        get = caches.get

        def hung(key: str) -> Any:
            time.sleep(seconds)
            return get(key)

        caches.get = hung

    (shard,) = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(f"{SHARD_NAME}:")]
    handle = ray.get_actor(shard["name"], namespace=shard["namespace"])
    old = str(describe("target")["replica"])
    app.stats.remote(reset=True).result()
    unready: list[float] = []  # seconds from the hang to the first failed readiness check (what /health asks)

    def watch() -> None:
        while time.monotonic() - started < 60 and not unready:
            try:
                app.ready.remote().result(timeout_s=10)
            except Exception:
                unready.append(time.monotonic() - started)
            time.sleep(0.1)

    def hang() -> None:
        handle.__ray_call__.remote(hang_verifies, 3600)
        threading.Thread(target=watch, daemon=True).start()

    started = time.monotonic()
    chunks = stream_with_fault(app, params(LONG), hang)
    seconds = time.monotonic() - started
    stats = app.stats.remote(reset=True).result()
    print(f"{seconds:.1f} s, verify calls by replica {stats['verify_calls']}")
    assert tokens_of(chunks) == hf_greedy(tiny_pair.target, PROMPT, LONG)
    assert chunks[-1]["finish_reason"] == "length"
    assert old in stats["verify_calls"] and len(stats["verify_calls"]) == 2, "the stream moved replicas"
    assert seconds < 60, "every stream completes within 60 s of the hang"
    assert unready and unready[0] < 3.0 + 2.0, f"/health's readiness fails past the 3 s deadline: {unready}"
    assert wait_until(lambda: replaced("target", old), timeout_s=60)
