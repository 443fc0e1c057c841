"""KV memory that adds up: a target replica filled to its admitted limit stays within the KV budget it advertises.

The target (SmolLM2-135M in float32, one shard process) has a small configured KV budget, `BUDGET` tokens. Four
requests of `PROMPT` + `MAX_TOKENS` tokens, each in a lane of its own (so four runners on the shard, one per lane
group), fill it exactly and decode at once. The shard's resident memory, sampled throughout, stays within its
level after loading the weights, plus the weights' file pages (mapped at load, read in by the first forwards),
plus the replica's advertised `kv_budget_bytes`, plus `ALLOWANCE` for the forwards' activations and the
allocator; its anonymous memory (where KV buffers and activations live) within its level plus the budget and
`ALLOWANCE`. Before one pool per shard, each runner preallocated 8 rows of up to 2,048 columns of its own: here
8 x 1,024 tokens x 46,080 bytes, 377 MB per runner against a 59 MB budget. The other half of line 3, an `n` x
window that can never fit refused with a 400: tests/unit/test_front_wiring.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from transformers import AutoConfig

from deploy.config import AppConfig
from speculative.engine.kv_budget import kv_bytes_per_token
from speculative.engine.kv_pool import pool_bytes
from tests.actors.serve_helpers import deployed, local_ray
from tests.fetched import fetched_dir
from tests.reliability.conftest import describe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BUDGET = 1024  # target_pool.kv_budget_tokens
PROMPT, MAX_TOKENS, REQUESTS = 192, 64, 4  # 4 x (192 + 64) = 1,024: the budget, reserved at once
ALLOWANCE = 64 << 20  # activations of a 192-token prefill forward and a decode, and the allocator's slack
MIB = 1 << 20


def rss_anon(pid: int) -> int:
    """Anonymous resident bytes of process `pid` (VmRSS less file-backed and shared pages), from /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no RssAnon for pid {pid}")


class Sampler:
    """The largest resident memory of a process, all of it and its anonymous part, sampled every 10 ms."""

    def __init__(self, pid: int) -> None:
        self.process, self.pid = psutil.Process(pid), pid
        self.rss = self.anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.rss = max(self.rss, self.process.memory_info().rss)
            self.anon = max(self.anon, rss_anon(self.pid))
            self._stop.wait(0.01)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    with local_ray(num_cpus=4):
        yield


def test_a_replica_filled_to_its_admitted_limit_stays_within_its_advertised_kv_budget(ray_local: None) -> None:
    model = fetched_dir("smollm2-135m")
    config = AppConfig.model_validate(
        {
            "target_model": str(model),
            "drafter": {"kind": "none"},
            "dtype": "float32",
            "torch_threads": 1,
            "target_pool": {"shard_num_cpus": 0.5, "kv_budget_tokens": BUDGET},
            "router_pool": {"num_cpus": 0.25, "router": {"max_lane_sequences": 1}},
        }
    )
    token_bytes = kv_bytes_per_token(AutoConfig.from_pretrained(model), torch.float32)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40_000, (PROMPT,), generator=gen).tolist() for _ in range(REQUESTS)]
    greedy = {"temperature": 0.0, "ignore_eos": True, "max_tokens": MAX_TOKENS}
    with deployed(config) as handle:
        info = handle.info.remote().result()
        assert info["kv_budget_tokens"] == BUDGET
        assert info["kv_budget_bytes"] == pool_bytes(BUDGET, token_bytes)
        shard = int(describe("target")["shards"][0]["pid"])
        base, base_anon = psutil.Process(shard).memory_info().rss, rss_anon(shard)
        reserved: list[int] = []

        def watch(done: threading.Event) -> None:
            while not done.is_set():
                reserved.append(int(describe("target")["kv_reserved_tokens"]))

        done = threading.Event()
        with Sampler(shard) as peak, ThreadPoolExecutor(REQUESTS + 1) as pool:
            watcher = pool.submit(watch, done)
            outs: list[dict[str, Any]] = list(
                pool.map(lambda p: handle.generate.remote(p, greedy).result(timeout_s=300), prompts)
            )
            done.set()
            watcher.result()
        after = describe("target")
    budget = info["kv_budget_bytes"]
    weights = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
    print(
        f"shard RSS: {base / MIB:.0f} MiB after loading, peak {peak.rss / MIB:.0f} MiB under load "
        f"(+{(peak.rss - base) / MIB:.0f} MiB; anonymous +{(peak.anon - base_anon) / MIB:.0f} MiB); weights "
        f"{weights / MIB:.0f} MiB, advertised KV budget {budget / MIB:.1f} MiB; KV held after "
        f"{after['kv_held_bytes'] / MIB:.1f} MiB; most reserved {max(reserved)} of {BUDGET} tokens"
    )
    assert all(len(o["token_ids"]) == MAX_TOKENS for o in outs)
    assert max(reserved) == BUDGET, "the four held the whole budget at once"
    assert after["kv_held_bytes"] <= budget
    # The weights' file pages are read in by the first forwards (they are mapped, not copied, at load).
    assert peak.rss <= base + weights + budget + ALLOWANCE, "resident memory past the weights + KV budget"
    assert peak.anon <= base_anon + budget + ALLOWANCE, "anonymous memory (KV buffers, activations) past the budget"
