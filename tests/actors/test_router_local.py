"""The router, draft workers and target replica as plain Python objects in one process (no Ray)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from ray.exceptions import OutOfMemoryError

from actors.config import DraftWorkerConfig, ModelConfig, RouterConfig, TargetConfig
from actors.draft_worker import DraftWorker
from actors.pools import LocalPool, ReplicaLost
from actors.records import StepRecord
from actors.router import GenerationFailed, Overloaded, Router, StreamTimeout
from actors.target_replica import LocalShards, TargetReplica
from actors.target_shard import TargetShard
from actors.wire import WireProposal, WireVerifyItem, Work
from speculative.drafters.config import DrafterConfig, drafter_config
from speculative.planning.load_control import QUOTE_RUN
from speculative.rules.acceptance import Verdict
from speculative.rules.sampling import SamplingParams
from speculative.rules.tree import TokenTree
from speculative.target import TargetVerifier
from tests.actors.conftest import VOCAB, TinyPair, hf_greedy, prompts_and_lengths


def fp32(path: str) -> ModelConfig:
    return ModelConfig(path=path, dtype="float32")


def make_router(pair: TinyPair, drafts: int = 1, drafter: DrafterConfig | None = None, **router: object) -> Router:
    target_cfg = TargetConfig(model=fp32(pair.target))
    target = TargetReplica(target_cfg, shards=LocalShards([TargetShard(target_cfg, 0)]))
    draft_cfg = DraftWorkerConfig(model=fp32(pair.draft), target_model=pair.target, drafter=drafter or drafter_config())
    workers = [DraftWorker(draft_cfg) for _ in range(drafts)]
    return Router(RouterConfig(**router), LocalPool(workers), LocalPool([target]))  # type: ignore[arg-type]


async def run_all(router: Router, requests: list[tuple[list[int], int]]) -> list[dict]:
    calls = [router.generate(p, {"temperature": 0.0, "max_tokens": m}) for p, m in requests]
    return list(await asyncio.gather(*calls))


@pytest.mark.parametrize(
    ("drafts", "pipelining", "lane_size"),
    [(1, True, 16), (2, True, 3), (1, False, 16)],
    ids=["one-draft-pingpong", "two-drafts-three-lanes", "sequential"],
)
def test_greedy_matches_target_alone(tiny_pair: TinyPair, drafts: int, pipelining: bool, lane_size: int) -> None:
    requests = prompts_and_lengths(10)
    router = make_router(tiny_pair, drafts, pipelining=pipelining, max_lane_sequences=lane_size)
    results = asyncio.run(run_all(router, requests))
    for (prompt, max_new), result in zip(requests, results, strict=True):
        assert result["token_ids"] == hf_greedy(tiny_pair.target, prompt, max_new)
        assert result["finish_reason"] in ("stop", "length")
    usage = [r["usage"] for r in results]
    assert sum(u["accepted"] for u in usage) > 0, "the noisy-copy draft should be accepted sometimes"
    assert all(u["acceptance_length"] >= 1.0 for u in usage)
    assert router._costs.verify.points, "the lanes measure verify costs, which set the load cap"


def test_prompt_lookup_drafts_in_the_router_without_a_draft_call(tiny_pair: TinyPair) -> None:
    """Prompt lookup costs ~0.1 ms a sequence, a call to the draft pool several: the router drafts by
    lookup itself. The tokens are the target's alone, drafts land, and the pool is never called."""
    requests = [(p * 3, m) for p, m in prompts_and_lengths(6)]  # prompts repeating themselves: matches
    lookup = drafter_config(kind="lookup")
    router = make_router(tiny_pair, drafter=lookup, lookup_ngrams=(3, 1))
    results = asyncio.run(run_all(router, requests))
    for (prompt, max_new), result in zip(requests, results, strict=True):
        assert result["token_ids"] == hf_greedy(tiny_pair.target, prompt, max_new)
    assert sum(r["usage"]["drafted"] for r in results) > 0
    assert [w._calls for w in router._draft.replicas] == [0]  # type: ignore[union-attr]


def test_quotes_draft_by_lookup_beside_the_draft_model(tiny_pair: TinyPair) -> None:
    """Beside a draft model the router drafts quotes (a match agreeing for 8+ tokens) by lookup and the
    rest on the draft pool, in the same lanes: the tokens are the target's alone, and where the target
    repeats its context the quote drafts landed."""
    requests = prompts_and_lengths(8, seed=3)
    quoted = [(p + p[: len(p) // 2] if len(p) >= 16 else p, m) for p, m in requests]  # half the prompt quoted
    router = make_router(tiny_pair, lookup_ngrams=(3, 1), lookup_quotes=True)
    results = asyncio.run(run_all(router, quoted))
    for (prompt, max_new), result in zip(quoted, results, strict=True):
        assert result["token_ids"] == hf_greedy(tiny_pair.target, prompt, max_new)
    assert sum(r["usage"]["accepted"] for r in results) > 0
    assert router._costs.draft_step.points  # the draft model drafted too
    tallies = {run: tally for run, tally in router._costs.pooled_by_match.items() if run >= QUOTE_RUN}
    print("quote drafts (accepted, trials) by run class:", tallies)
    assert tallies and max(accepted for accepted, _ in tallies.values()) > 0


def test_stream_chunks_add_up_and_requests_join_late(tiny_pair: TinyPair) -> None:
    router = make_router(tiny_pair)
    (p1, m1), (p2, m2) = prompts_and_lengths(2, seed=11)

    async def scenario() -> tuple[list[dict], dict]:
        chunks = []
        late = None
        async for chunk in router.generate_stream(p1, {"temperature": 0.0, "max_tokens": m1}):
            chunks.append(chunk)
            if late is None:  # a second request joins a running batch
                late = asyncio.ensure_future(router.generate(p2, {"temperature": 0.0, "max_tokens": m2}))
        assert late is not None
        return chunks, await late

    chunks, second = asyncio.run(scenario())
    assert [t for c in chunks for t in c["token_ids"]] == hf_greedy(tiny_pair.target, p1, m1)
    assert chunks[-1]["finish_reason"] is not None and "usage" in chunks[-1]
    assert all(c["finish_reason"] is None for c in chunks[:-1])
    assert second["token_ids"] == hf_greedy(tiny_pair.target, p2, m2)


def test_sampled_requests_are_reproducible(tiny_pair: TinyPair) -> None:
    """Same seed, other batch composition and lane layout: the same tokens (keyed randomness)."""
    requests = prompts_and_lengths(4, seed=5)
    params = [{"temperature": 0.8, "top_k": 20, "max_tokens": m, "seed": 100 + i} for i, (_, m) in enumerate(requests)]

    async def together() -> list[dict]:
        router = make_router(tiny_pair)
        return list(
            await asyncio.gather(*[router.generate(p, sp) for (p, _), sp in zip(requests, params, strict=True)])
        )

    async def alone() -> list[dict]:
        router = make_router(tiny_pair, pipelining=False)
        return [await router.generate(p, sp) for (p, _), sp in zip(requests, params, strict=True)]

    assert [r["token_ids"] for r in asyncio.run(together())] == [r["token_ids"] for r in asyncio.run(alone())]


def test_cancel_frees_caches(tiny_pair: TinyPair) -> None:
    router = make_router(tiny_pair)
    prompt, _ = prompts_and_lengths(1)[0]

    async def scenario() -> None:
        stream = router.generate_stream(prompt, {"temperature": 0.0, "max_tokens": 500, "ignore_eos": True})
        await stream.__anext__()
        await stream.aclose()  # the client went away
        for _ in range(200):
            if not router._lanes:
                break
            await asyncio.sleep(0.01)
        assert not router._lanes and not router._live

    asyncio.run(scenario())
    target = router._target.replicas[0]  # type: ignore[attr-defined]
    verifiers = target.shards.shards[0]._verifiers
    assert all(not verifiers.peek(k).runner.rows for k in list(verifiers._owners))


def test_bad_input_and_overload(tiny_pair: TinyPair) -> None:
    router = make_router(tiny_pair, max_active_sequences=1)

    async def scenario() -> None:
        with pytest.raises(ValueError, match="prompt_token_ids"):
            await router.generate([999_999], {})
        with pytest.raises(ValueError, match="temperature"):
            await router.generate([5, 6], {"temperature": -1})
        with pytest.raises(ValueError, match="stop"):
            await router.generate([5, 6], {"stop": ["x"]})
        first = router.generate_stream([5, 6], {"max_tokens": 50, "ignore_eos": True})
        await first.__anext__()
        with pytest.raises(Overloaded):
            await router.generate([5, 6], {})
        await first.aclose()

    asyncio.run(scenario())


def test_overhead_counts_time_in_neither_pool() -> None:
    record = StepRecord(0.0, 10.0, Work(1.0, 5.0), Work(3.0, 8.0), 1, 1, 2)
    assert record.overhead == pytest.approx(3.0)  # covered: 1..8
    assert StepRecord(0.0, 2.0, None, None, 0, 0, 0).overhead == pytest.approx(2.0)


class Flaky:
    """A pool that fails some calls of one method; `on_fail` may replace the replica (a restart)."""

    def __init__(self, inner: LocalPool, method: str, fail_calls: set[int], on_fail: object = None) -> None:
        self.inner, self.method, self.fail_calls, self.on_fail = inner, method, fail_calls, on_fail
        self.calls = 0

    async def call(self, method: str, lane: str | None, *args: object) -> object:
        if method == self.method:
            self.calls += 1
            if self.calls in self.fail_calls:
                if callable(self.on_fail):
                    self.on_fail()
                raise ReplicaLost("replica lost")
        return await self.inner.call(method, lane, *args)


def test_draft_failure_never_fails_a_request(tiny_pair: TinyPair) -> None:
    router = make_router(tiny_pair, draft_backoff_s=0.0)
    router._draft = Flaky(router._draft, "propose", set(range(1, 10_000)))  # type: ignore[arg-type]
    requests = prompts_and_lengths(4)
    results = asyncio.run(run_all(router, requests))
    for (prompt, max_new), result in zip(requests, results, strict=True):
        assert result["token_ids"] == hf_greedy(tiny_pair.target, prompt, max_new)
        assert result["usage"]["drafted"] == 0  # decoded without speculation


def test_target_restart_mid_request_reprefills(tiny_pair: TinyPair) -> None:
    """The target replica is replaced (caches lost) mid-stream: the retry re-prefills, output unchanged."""
    router = make_router(tiny_pair)
    pool = router._target
    config = TargetConfig(model=fp32(tiny_pair.target))

    def restart() -> None:
        pool.replicas[0] = TargetReplica(config, shards=LocalShards([TargetShard(config, 0)]))  # type: ignore[attr-defined]

    router._target = Flaky(pool, "verify", {3, 7}, restart)  # type: ignore[arg-type,assignment]
    requests = prompts_and_lengths(4)
    results = asyncio.run(run_all(router, requests))
    for (prompt, max_new), result in zip(requests, results, strict=True):
        assert result["token_ids"] == hf_greedy(tiny_pair.target, prompt, max_new)
    assert router._target.calls > 7  # type: ignore[attr-defined]


def test_a_row_that_fails_at_the_target_ends_alone(tiny_pair: TinyPair) -> None:
    """Sampling one row fails after the forward (its distribution has no mass): that row's verdict carries the
    error, the other row of the same call gets its verdict, and the group's cache serves the next call."""
    config = TargetConfig(model=fp32(tiny_pair.target))
    target = TargetReplica(config, shards=LocalShards([TargetShard(config, 0)]))
    prompt = (5, 6, 7, 8)
    bad = SamplingParams.model_construct(**(SamplingParams().model_dump() | {"repetition_penalty": 1e-300}))
    good = SamplingParams(temperature=0.0)
    chain = WireProposal(TokenTree.chain(prompt[-1], [9, 10]), None)

    async def scenario() -> tuple[list[Verdict], list[int]]:
        items = [WireVerifyItem("s1", prompt, bad, chain), WireVerifyItem("s2", prompt, good, chain)]
        both = await target.verify("g", items, [])
        again = await target.verify("g", [WireVerifyItem("s3", prompt, good, chain)], [])
        return both.verdicts, list(again.verdicts[0].tokens)

    (failed, verdict), tokens = asyncio.run(scenario())
    assert failed.error is not None and "no mass" in failed.error and not failed.tokens
    assert verdict.error is None and list(verdict.tokens) == tokens
    assert tokens[-1] == hf_greedy(tiny_pair.target, list(prompt) + tokens[:-1], 1)[0]


def test_a_request_whose_row_fails_ends_with_the_cause_and_its_group_goes_on(tiny_pair: TinyPair) -> None:
    """Eight requests in one group (no pipelining: one verify carries them all), one of them with a grammar the
    shard cannot apply (the tiny target has no tokenizer for its grammar compiler): that request fails naming
    the cause; the seven others finish with the tokens they give alone (before: the whole group ended with
    "target pool unavailable")."""
    router = make_router(tiny_pair, pipelining=False)
    requests = prompts_and_lengths(7)
    doomed = {"temperature": 0.0, "max_tokens": 8, "grammar": {"kind": "regex", "text": "[a-z]+"}}

    async def scenario() -> list[object]:
        calls = [router.generate(p, {"temperature": 0.0, "max_tokens": m}) for p, m in requests]
        return list(await asyncio.gather(router.generate([5, 6, 7, 8], doomed), *calls, return_exceptions=True))

    failed, *results = asyncio.run(scenario())
    assert isinstance(failed, GenerationFailed) and "grammar" in str(failed), failed
    for (prompt, max_new), result in zip(requests, results, strict=True):
        assert isinstance(result, dict), result
        assert result["token_ids"] == hf_greedy(tiny_pair.target, prompt, max_new)


@pytest.mark.parametrize("device_round", [False, True], ids=["host-round", "device-round"])
def test_a_request_whose_logits_turn_nan_ends_alone_and_its_group_goes_on(
    tiny_pair: TinyPair, device_round: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The target's embedding of one token set to NaN (a model whose arithmetic fails on some input): the request
    whose prompt holds that token ends saying its logits are NaN, instead of decoding the NaN's argmax as a token;
    the seven requests verified in the same forwards finish with the tokens they give alone."""
    init = TargetVerifier.__init__

    def rounding(self: TargetVerifier, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.device_round = device_round  # the GPU's path too, on this CPU

    monkeypatch.setattr(TargetVerifier, "__init__", rounding)
    router = make_router(tiny_pair, pipelining=False)
    requests = prompts_and_lengths(7)
    expected = [hf_greedy(tiny_pair.target, p, m) for p, m in requests]
    used = {t for (p, _), out in zip(requests, expected, strict=True) for t in p + out}
    poison = max(set(range(VOCAB)) - used)  # a token none of the seven reads
    asyncio.run(router.generate([5, 6, 7], {"temperature": 0.0, "max_tokens": 2}))  # the shard's verifier exists
    (shard,) = router._target.replicas[0].shards.shards  # type: ignore[attr-defined]
    model = shard._verifiers.owners()[0].runner.model
    with torch.no_grad():
        model.get_input_embeddings().weight[poison] = float("nan")

    async def scenario() -> list[object]:
        calls = [router.generate(p, {"temperature": 0.0, "max_tokens": m}) for p, m in requests]
        doomed = router.generate([5, poison, 7, 8], {"temperature": 0.0, "max_tokens": 8})
        return list(await asyncio.gather(doomed, *calls, return_exceptions=True))

    failed, *results = asyncio.run(scenario())
    assert isinstance(failed, GenerationFailed) and "NaN" in str(failed), failed
    assert [r["token_ids"] for r in results] == expected  # type: ignore[index]


class Slow:
    """A pool whose verify calls take `delay_s` longer (a target under load)."""

    def __init__(self, inner: LocalPool, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s

    async def call(self, method: str, lane: str | None, *args: object) -> object:
        if method == "verify":
            await asyncio.sleep(self.delay_s)
        return await self.inner.call(method, lane, *args)


def test_a_stream_past_max_stream_s_ends_with_stream_timeout_and_is_freed(tiny_pair: TinyPair) -> None:
    router = make_router(tiny_pair, max_stream_s=1.0)
    router._target = Slow(router._target, 0.2)  # type: ignore[arg-type,assignment]
    prompt = [5, 17, 33]

    async def run() -> tuple[list[int], BaseException | None, dict]:
        tokens: list[int] = []
        try:
            async for chunk in router.generate_stream(prompt, {"temperature": 0.0, "max_tokens": 200}):
                tokens += chunk["token_ids"]
        except StreamTimeout as e:
            return tokens, e, await router.generate(prompt, {"temperature": 0.0, "max_tokens": 2})
        return tokens, None, {}

    tokens, error, short = asyncio.run(run())
    assert error is not None and "max_stream_s (1 s)" in str(error), "200 rounds of 0.2 s outlive 1 s"
    assert 0 < len(tokens) < 200 and tokens == hf_greedy(tiny_pair.target, prompt, len(tokens))
    assert short["token_ids"] == hf_greedy(tiny_pair.target, prompt, 2), "a short one completes"
    assert not router._live, "the timed-out sequence is freed"


def test_a_verify_killed_for_memory_is_not_retried_and_says_so(tiny_pair: TinyPair) -> None:
    """Ray's memory monitor killed the shard mid-forward: retrying the same forward would kill the replacement."""
    router = make_router(tiny_pair)
    inner = router._target

    class OutOfMemoryOnce(Flaky):
        async def call(self, method: str, lane: str | None, *args: object) -> object:
            if method == "verify" and self.calls == 0:
                self.calls += 1
                raise OutOfMemoryError("1 worker(s) were killed due to the node running low on memory")
            return await self.inner.call(method, lane, *args)

    router._target = OutOfMemoryOnce(inner, "verify", set())  # type: ignore[arg-type,assignment]
    with pytest.raises(RuntimeError, match="out of memory"):
        asyncio.run(router.generate([5, 17, 33], {"temperature": 0.0, "max_tokens": 4}))
    again = asyncio.run(router.generate([5, 17, 33], {"temperature": 0.0, "max_tokens": 4}))
    assert again["token_ids"] == hf_greedy(tiny_pair.target, [5, 17, 33], 4)
