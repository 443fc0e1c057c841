"""Admission by KV memory, with the router, draft worker and target replica in one process (tiny fp32 models).

The target replica has a small configured KV budget. A prompt filling the advertised window is
prefilled while four streams on the same replica keep their pace; a request over the window is
refused naming the limit; one that must wait for room is refused as overloaded (HTTP 429) and
served once room is back; no reservation outlives its sequence: finished, cancelled mid-stream,
cancelled while being admitted, or failed; and a group whose rows' padding passes the replica's KV pool
fails saying so.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import statistics
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
import torch

from actors.config import DraftWorkerConfig, ModelConfig, RouterConfig, TargetConfig
from actors.draft_worker import DraftWorker
from actors.pools import LocalPool
from actors.router import Overloaded, Router
from actors.target_replica import LocalShards, TargetReplica
from actors.target_shard import TargetShard
from tests.actors.conftest import VOCAB, TinyPair, hf_greedy, llama_config, save_random

WINDOW = 512  # the tiny target's max_position_embeddings
BUDGET = 2048  # its replica's KV budget: the window plus four streams of 4-25 + 300 tokens fit
CHUNK = 4  # prefill_chunk_tokens: as many prompt tokens per round as the four streams decode (126 rounds)
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> TinyPair:
    """A target wide enough that a round is milliseconds of compute, and a small draft."""
    root = tmp_path_factory.mktemp("kv")
    wide = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4}
    save_random(llama_config(max_position_embeddings=WINDOW, **wide), root / "target", seed=0)
    save_random(llama_config(max_position_embeddings=WINDOW, num_hidden_layers=1), root / "draft", seed=1)
    return TinyPair(str(root / "target"), str(root / "draft"))


def make(
    pair: TinyPair,
    drafts: bool = True,
    target_pool: type[LocalPool] = LocalPool,
    budget: int = BUDGET,
    chunk: int = CHUNK,
    **router_config: Any,
) -> tuple[Router, TargetReplica]:
    fp32 = {"dtype": "float32", "torch_threads": 1}
    config = TargetConfig(
        model=ModelConfig(path=pair.target, **fp32), prefill_chunk_tokens=chunk, kv_budget_tokens=budget
    )
    target = TargetReplica(config, shards=LocalShards([TargetShard(config, 0)]))
    draft = DraftWorker(DraftWorkerConfig(model=ModelConfig(path=pair.draft, **fp32), target_model=pair.target))
    router = Router(RouterConfig(**router_config), LocalPool([draft]) if drafts else None, target_pool([target]))
    return router, target


async def reserved(target: TargetReplica) -> tuple[int, int]:
    """(tokens, sequences) the replica's KV ledger holds."""
    described = await target.describe()
    return described["kv_reserved_tokens"], described["kv_reserved_sequences"]


async def settled(target: TargetReplica) -> tuple[int, int]:
    """`reserved` once the lanes had time to release what left them (between rounds, or once a lane empties)."""
    for _ in range(200):
        if await reserved(target) == (0, 0):
            break
        await asyncio.sleep(0.01)
    return await reserved(target)


def gaps(arrivals: list[list[float]], start: float, end: float) -> tuple[list[float], list[float]]:
    """The streams' gaps between deliveries: (those overlapping start..end, the others)."""
    during: list[float] = []
    usual: list[float] = []
    for times in arrivals:
        for a, b in itertools.pairwise(times):
            (during if b > start and a < end else usual).append(b - a)
    return during, usual


async def window_filling(router: Router, target: TargetReplica, short: list[list[int]], long_prompt: list[int]) -> Any:
    """Four streams of 300 tokens; after their 20th delivery the long prompt joins; meanwhile a request one token
    over what is left of the budget is refused, and served once the five are done."""
    info = await router.info()
    streams = [router.generate_stream(p, GREEDY | {"max_tokens": 300}) for p in short]
    outs = [list((await s.__anext__())["token_ids"]) for s in streams]
    wall: list[list[float]] = [[time.monotonic()] for _ in streams]
    cpu: list[list[float]] = [[time.process_time()] for _ in streams]
    span: list[tuple[float, float]] = []  # (wall, cpu) when the long prompt was sent, when its first token came

    async def drain(i: int) -> None:
        async for chunk in streams[i]:
            wall[i].append(time.monotonic())
            cpu[i].append(time.process_time())
            outs[i] += chunk["token_ids"]

    async def long_request() -> list[int]:
        while min(len(w) for w in wall) < 20:  # the usual pace first
            await asyncio.sleep(0.005)
        span.append((time.monotonic(), time.process_time()))
        stream = router.generate_stream(long_prompt, GREEDY | {"max_tokens": 8})
        tokens = list((await stream.__anext__())["token_ids"])
        span.append((time.monotonic(), time.process_time()))
        return tokens + [t async for c in stream for t in c["token_ids"]]

    async def must_wait() -> tuple[int, str, dict[str, Any]]:
        while (await reserved(target))[1] < 5:
            await asyncio.sleep(0.005)
        held, _ = await reserved(target)
        prompt, asked = [5, 6, 7, 8], GREEDY | {"max_tokens": BUDGET - held - 4 + 1}
        with pytest.raises(Overloaded, match="KV budget") as refused:
            await router.generate(prompt, asked)
        await tasks  # room is back once the five are done
        return held, str(refused.value), await router.generate(prompt, asked)

    tasks = asyncio.gather(long_request(), *[drain(i) for i in range(4)])
    waited = await must_wait()
    long_out = (await tasks)[0]
    return {"info": info, "outs": outs, "wall": wall, "cpu": cpu, "span": span, "long": long_out, "waited": waited}


T = TypeVar("T")
TRIES = 3  # runs of the prefill whose gaps are measured; the best counts (see below)


async def frozen(run: Coroutine[Any, Any, T]) -> T:
    """`run` with the start-up heap frozen, as in a replica's process (actors/heap.py): here the router and
    replica share the test's process, whose full collections (~300 ms) would be stalls no server has."""
    gc.freeze()
    try:
        return await run
    finally:
        gc.unfreeze()


def test_a_window_filling_prompt_keeps_four_streams_at_pace_and_waiting_requests_get_overloaded(
    pair: TinyPair,
) -> None:
    """Four streams decode on the target replica; a prompt filling the window joins and is prefilled in chunks
    between their rounds, while the streams' largest gap stays within 3x their usual (median) one; a request
    that must wait for KV room is refused as overloaded, then served; no reservation is left.

    Gaps are measured in this process's CPU time (router and replica are in it; wall-clock gaps on a shared
    machine also hold other processes' time slices; both are printed). A single stall of the process outside
    the server's rounds (a page fault, the allocator) can still exceed the bound in one run, so the best of
    TRIES runs is held to it; a round carrying more than its chunk exceeds it in every run. No draft pool:
    the gaps are the target replica's rounds alone.
    """
    gen = torch.Generator().manual_seed(3)
    short = [torch.randint(3, VOCAB, (4 + 7 * i,), generator=gen).tolist() for i in range(4)]
    long_prompt = torch.randint(3, VOCAB, (WINDOW - 8,), generator=gen).tolist()
    ratios = []
    for _ in range(TRIES):
        router, target = make(pair, drafts=False)
        result = asyncio.run(frozen(window_filling(router, target, short, long_prompt)))
        assert result["info"]["context_window"] == WINDOW
        assert "max_position_embeddings" in result["info"]["context_limit"]
        assert result["info"]["kv_budget_tokens"] == BUDGET
        for prompt, out in zip(short, result["outs"], strict=True):
            assert out == hf_greedy(pair.target, prompt, 300)
        assert result["long"] == hf_greedy(pair.target, long_prompt, 8)
        held, refusal, served = result["waited"]
        assert held == WINDOW + sum(len(p) + 300 for p in short), "the five hold their whole prompt + max_tokens"
        assert f"{held} of {BUDGET} tokens reserved" in refusal
        assert len(served["token_ids"]) == BUDGET - held - 3
        assert asyncio.run(settled(target)) == (0, 0)
        (sent, sent_cpu), (first, first_cpu) = result["span"]
        during, usual = gaps(result["cpu"], sent_cpu, first_cpu)
        assert len(during) >= 4 * (len(long_prompt) // CHUNK - 1), "the streams emit in every round of the prefill"
        wall_during, wall_usual = gaps(result["wall"], sent, first)
        largest, median = max(during), statistics.median(usual)
        wall_max, wall_median = max(wall_during), statistics.median(wall_usual)
        print(
            f"prefill of {len(long_prompt)} tokens in {first - sent:.2f} s; the four streams' gaps during it: "
            f"CPU max {largest * 1e3:.1f} ms / usual {median * 1e3:.1f} ms = {largest / median:.2f}x, "
            f"wall max {wall_max * 1e3:.1f} ms / usual {wall_median * 1e3:.1f} ms = {wall_max / wall_median:.2f}x"
        )
        ratios.append(largest / median)
        if ratios[-1] <= 3:
            break
    assert min(ratios) <= 3, f"the largest gap during the prefill is {min(ratios):.2f}x the usual at best"


def test_a_request_over_the_window_is_refused_naming_the_limit(pair: TinyPair) -> None:
    router, target = make(pair)

    async def scenario() -> None:
        with pytest.raises(ValueError, match=f"max_tokens: .* context window of {WINDOW} tokens .*max_position"):
            await router.generate([5] * 10, GREEDY | {"max_tokens": WINDOW - 9})
        with pytest.raises(ValueError, match=f"prompt_token_ids: {WINDOW} tokens"):
            await router.generate([5] * WINDOW, GREEDY | {"max_tokens": 1})
        out = await router.generate([5] * 10, GREEDY | {"max_tokens": WINDOW - 10})  # exactly the window
        assert len(out["token_ids"]) == WINDOW - 10
        assert await settled(target) == (0, 0)

    asyncio.run(scenario())


class Hop(LocalPool):
    """A pool whose calls take a network hop's time, as Serve handles do: a caller is suspended in each."""

    async def call(self, method: str, lane: str | None, *args: Any) -> Any:
        await asyncio.sleep(0.01)
        return await super().call(method, lane, *args)


class SlowReserve(LocalPool):
    """A pool whose reservations are granted, then answered only after a long while (a slow network)."""

    async def call(self, method: str, lane: str | None, *args: Any) -> Any:
        answer = await super().call(method, lane, *args)
        if method == "reserve":
            await asyncio.sleep(60)
        return answer


def test_no_reservation_outlives_its_sequence(pair: TinyPair, monkeypatch: pytest.MonkeyPatch) -> None:
    router, target = make(pair)

    async def cancelled_mid_stream() -> None:
        stream = router.generate_stream([5, 6, 7], GREEDY | {"max_tokens": 400})
        await stream.__anext__()
        assert await reserved(target) == (403, 1)
        await stream.aclose()

    async def failed() -> None:
        verify = TargetShard.verify

        def broken(self: TargetShard, *args: Any) -> Any:
            monkeypatch.setattr(TargetShard, "verify", verify)  # once
            raise ValueError("a verify that fails")

        monkeypatch.setattr(TargetShard, "verify", broken)
        with pytest.raises(RuntimeError, match=r"a verify that fails|internal error|unavailable"):
            await router.generate([5, 6, 7], GREEDY | {"max_tokens": 40})

    async def scenario() -> None:
        await cancelled_mid_stream()
        assert await settled(target) == (0, 0), "cancelled mid-stream"
        await failed()
        assert await settled(target) == (0, 0), "failed"

    asyncio.run(scenario())

    slow_router, slow_target = make(pair, target_pool=SlowReserve)

    async def cancelled_while_admitted() -> tuple[int, int]:
        task = asyncio.ensure_future(slow_router.generate([5, 6, 7], GREEDY | {"max_tokens": 40}))
        while (await reserved(slow_target)) == (0, 0):
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await settled(slow_target)  # the router's release of it

    assert asyncio.run(cancelled_while_admitted()) == (0, 0), "cancelled while being admitted"


def test_a_burst_spreads_over_lanes_while_its_reservations_are_asked_for(pair: TinyPair) -> None:
    """Admission awaits the target replica's reservation; the requests still waiting for theirs count as their
    lane's, so ten at once fill lanes of three rather than all joining the first."""
    router, _ = make(pair, target_pool=Hop, max_lane_sequences=3)

    async def scenario() -> list[int]:
        streams = [router.generate_stream([5, 6, i + 7], GREEDY | {"max_tokens": 40}) for i in range(10)]
        firsts = await asyncio.gather(*[s.__anext__() for s in streams])
        sizes = sorted(len(lane) for lane in router._lanes.values())
        for s in streams:
            await s.aclose()
        assert all(f["token_ids"] for f in firsts)
        return sizes

    assert asyncio.run(scenario()) == [1, 3, 3, 3]


class SilentDraft(LocalPool):
    """A draft pool whose replica is being replaced: Serve holds every call until one is up."""

    async def call(self, method: str, lane: str | None, *args: Any) -> Any:
        await asyncio.sleep(3600)


def test_a_silent_draft_pool_does_not_hold_admission(pair: TinyPair) -> None:
    """The window is fetched with the draft pool's limits, which wait at most draft_timeout_s."""
    config = TargetConfig(model=ModelConfig(path=pair.target, dtype="float32"), kv_budget_tokens=BUDGET)
    target = TargetReplica(config, shards=LocalShards([TargetShard(config, 0)]))
    router = Router(RouterConfig(draft_timeout_s=0.2), SilentDraft([object()]), LocalPool([target]))

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        info = await asyncio.wait_for(router.info(), 10)
        return info, await asyncio.wait_for(router.generate([5, 6, 7], GREEDY | {"max_tokens": 4}), 60)

    info, out = asyncio.run(scenario())
    assert info["context_window"] == WINDOW and len(out["token_ids"]) == 4


def test_a_finished_sequence_leaves_the_ledger_while_its_lane_goes_on(pair: TinyPair) -> None:
    """Pipelining plays two groups per lane; a request that finishes in one while a long one streams in the other
    leaves the replica's ledger at once (its group has no next verify to carry the release), so the replica does
    not count it as waiting for a long prompt's forwards (`prefill_round_factor`) nor against its KV budget."""
    router, target = make(pair, pipelining=True)

    async def scenario() -> tuple[tuple[int, int], tuple[int, int]]:
        long = router.generate_stream([5, 6, 7], GREEDY | {"max_tokens": 400})
        await long.__anext__()
        await router.generate([9, 10, 11], GREEDY | {"max_tokens": 4})
        for _ in range(50):  # a round or two for the release to land (the long one runs for seconds yet)
            if (await reserved(target))[1] == 1:
                break
            await asyncio.sleep(0.002)
        during = await reserved(target)
        await long.aclose()
        return during, await settled(target)

    during, after = asyncio.run(scenario())
    assert during == (403, 1), "the short request is released while the long one streams on"
    assert after == (0, 0)


def test_a_group_padded_past_the_kv_pool_fails_naming_it(pair: TinyPair) -> None:
    """Admission counts tokens; a group's KV buffers hold its rows padded to the longest. Sequences of 330 + 90 and
    8 + 84 tokens fill a budget of 512, but in one group (no pipelining) they need 2 rows x 352 columns once the long
    prompt is in (the verifier makes room for a whole prompt at its first forward): past the pool's 512 x 5/4 = 640
    cells. That forward fails before allocating, both requests end saying why, and the replica holds nothing after
    (`speculative/engine/kv_pool.py`)."""
    router, target = make(pair, drafts=False, budget=512, chunk=256, pipelining=False)

    async def scenario() -> list[BaseException | dict[str, Any]]:
        long, short = [3 + i % 90 for i in range(330)], [5, 6, 7, 8, 9, 10, 11, 12]
        asked = [
            router.generate(long, GREEDY | {"max_tokens": 90}),
            router.generate(short, GREEDY | {"max_tokens": 84}),
        ]
        return list(await asyncio.gather(*asked, return_exceptions=True))

    outcomes = asyncio.run(scenario())
    for outcome in outcomes:
        assert isinstance(outcome, RuntimeError), outcome
        assert "out of KV memory: KV pool full" in str(outcome) and "target_pool.kv_budget_tokens 512" in str(outcome)
    assert asyncio.run(settled(target)) == (0, 0)
    assert asyncio.run(target.describe())["kv_held_bytes"] == 0
