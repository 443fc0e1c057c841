"""Chunked prefill: a long prompt is prefilled over several rounds while other streams keep emitting.

The router, draft worker and target replica in one process (tiny fp32 models): every forward of the
target carries at most `prefill_chunk_tokens` prompt tokens, the short streams commit tokens in every
round of the long prefill, and every output is the target's own greedy continuation.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from actors.config import DraftWorkerConfig, ModelConfig, RouterConfig, TargetConfig
from actors.draft_worker import DraftWorker
from actors.pools import LocalPool
from actors.router import Router
from actors.target_replica import LocalShards, TargetReplica
from actors.target_shard import TargetShard
from speculative.drafters.base import Proposal
from speculative.engine.runner import ModelRunner
from speculative.rules.sampling import SamplingParams
from speculative.rules.tree import TokenTree
from speculative.target import TargetVerifier, VerifyItem
from tests.actors.conftest import VOCAB, TinyPair, _cached_model, hf_greedy, prompts_and_lengths

CHUNK = 16


def test_a_forward_carries_at_most_the_chunk_budget_over_all_rows(tiny_pair: TinyPair) -> None:
    """The docstring's example, budget 4: catch-ups 0, 6, 3 take three calls, the shortest catch-up first."""
    verifier = TargetVerifier(ModelRunner(_cached_model(tiny_pair.target)), prefill_chunk=4)
    greedy = SamplingParams(temperature=0.0)
    prompts = {"a": [5], "b": [7, 8, 9, 10, 11, 12, 13], "c": [20, 21, 22, 23]}
    (first,) = verifier.verify([VerifyItem("a", (5,), greedy, Proposal(TokenTree.chain(5, [])))])
    tokens = {k: list(v) for k, v in prompts.items()}
    tokens["a"] += first.tokens  # "a" is decoding: its cache holds all but its root
    pending = []
    for _ in range(3):
        items = [VerifyItem(k, tuple(t), greedy, Proposal(TokenTree.chain(t[-1], []))) for k, t in tokens.items()]
        verdicts = verifier.verify(items)
        pending.append([not v.tokens for v in verdicts])
        for t, v in zip(tokens.values(), verdicts, strict=True):
            t += v.tokens
    assert pending == [[False, True, False], [False, True, False], [False, False, False]]
    for k, prompt in prompts.items():  # the prefilled rows continue exactly as the target alone
        assert tokens[k][len(prompt) :] == hf_greedy(tiny_pair.target, prompt, len(tokens[k]) - len(prompt))


def test_a_long_prompt_is_prefilled_between_the_rounds_of_four_streams(
    tiny_pair: TinyPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    target_cfg = TargetConfig(model=ModelConfig(path=tiny_pair.target, dtype="float32"), prefill_chunk_tokens=CHUNK)
    target = TargetReplica(target_cfg, shards=LocalShards([TargetShard(target_cfg, 0)]))
    draft_cfg = DraftWorkerConfig(
        model=ModelConfig(path=tiny_pair.draft, dtype="float32"), target_model=tiny_pair.target
    )
    config = RouterConfig(pipelining=False, depth={"load_adaptive": False})
    router = Router(config, LocalPool([DraftWorker(draft_cfg)]), LocalPool([target]))  # type: ignore[arg-type]
    sizes: list[int] = []  # new tokens of every target forward
    forward = ModelRunner.forward_hidden  # every forward goes through it (`forward` adds the head)

    def counted(self: ModelRunner, tokens: list[list[int]], *args: Any) -> Any:
        if self.model.config._name_or_path == tiny_pair.target:
            sizes.append(sum(len(t) for t in tokens))
        return forward(self, tokens, *args)

    monkeypatch.setattr(ModelRunner, "forward_hidden", counted)
    gen = torch.Generator().manual_seed(3)
    long_prompt = torch.randint(3, VOCAB, (12 * CHUNK,), generator=gen).tolist()
    short = [p for p, _ in prompts_and_lengths(4, seed=8)]
    greedy = {"temperature": 0.0, "ignore_eos": True}

    async def scenario() -> tuple[list[list[int]], dict, list[int]]:
        streams = [router.generate_stream(p, greedy | {"max_tokens": 240}) for p in short]
        outs = [list((await s.__anext__())["token_ids"]) for s in streams]  # the four are decoding
        during = [0] * len(streams)  # chunks each got while the long prompt was being prefilled
        long_task = asyncio.ensure_future(router.generate(long_prompt, greedy | {"max_tokens": 8}))

        async def drain(i: int) -> None:
            async for chunk in streams[i]:
                outs[i] += chunk["token_ids"]
                during[i] += not long_task.done()

        await asyncio.gather(*[drain(i) for i in range(len(streams))])
        return outs, await long_task, during

    outs, long_out, during = asyncio.run(scenario())
    assert sizes, "the target's forwards were counted"
    for prompt, out in zip(short, outs, strict=True):
        assert out == hf_greedy(tiny_pair.target, prompt, 240)
    assert long_out["token_ids"] == hf_greedy(tiny_pair.target, long_prompt, 8)
    rounds = len(long_prompt) // CHUNK
    assert min(during) >= rounds - 1, f"each stream gets tokens in every round of the long prefill: {during}"
    # A forward holds at most a chunk of prompt plus the five sequences' trees (root + 4 drafts each),
    # whatever the prompt's length (here 12 chunks).
    assert max(sizes) <= CHUNK + 5 * (1 + 4), sizes


def test_the_replica_sizes_each_chunk_to_the_streams_round_from_the_forwards_it_measured(
    tiny_pair: TinyPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`prefill_round_factor` 2, target forwards that cost 20 ms plus 2 ms a token (a sleep in the forward, as a
    CPU's cost), `prefill_chunk_tokens` 256. A long prompt alone on the replica is prefilled in chunks of 256;
    beside two decoding streams, in chunks the replica sized by the verify calls it measured so that a call
    carrying one takes about twice the streams' round alone, never much more. Every output is the target's."""
    target_cfg = TargetConfig(
        model=ModelConfig(path=tiny_pair.target, dtype="float32"), prefill_chunk_tokens=256, prefill_round_factor=2
    )
    shard = TargetShard(target_cfg, 0)
    target = TargetReplica(target_cfg, shards=LocalShards([shard]))
    draft_cfg = DraftWorkerConfig(
        model=ModelConfig(path=tiny_pair.draft, dtype="float32"), target_model=tiny_pair.target
    )
    config = RouterConfig(pipelining=False, depth={"load_adaptive": False})
    router = Router(config, LocalPool([DraftWorker(draft_cfg)]), LocalPool([target]))  # type: ignore[arg-type]
    forward, verify = ModelRunner.forward_hidden, TargetShard.verify
    calls: list[tuple[int, float, bool]] = []  # every verify call's (tokens, seconds, carried a chunk)
    gen = torch.Generator().manual_seed(5)
    first, long_prompt = (torch.randint(3, VOCAB, (600,), generator=gen).tolist() for _ in range(2))

    def costed(self: ModelRunner, tokens: list[list[int]], *args: Any) -> Any:
        if self.model.config._name_or_path == tiny_pair.target:
            time.sleep(0.02 + 0.002 * sum(len(t) for t in tokens))
        return forward(self, tokens, *args)

    def timed(self: TargetShard, cache_key: str, items: list[Any], *args: Any) -> Any:
        verdicts, work = verify(self, cache_key, items, *args)
        chunk = any(len(i.tokens) >= len(long_prompt) and not v.tokens for i, v in zip(items, verdicts, strict=True))
        calls.append((work.tokens, work.seconds, chunk))
        return verdicts, work

    monkeypatch.setattr(ModelRunner, "forward_hidden", costed)
    monkeypatch.setattr(TargetShard, "verify", timed)
    short = [p for p, _ in prompts_and_lengths(2, seed=8)]
    greedy = {"temperature": 0.0, "ignore_eos": True}

    async def scenario() -> tuple[dict, list[list[int]], dict]:
        await asyncio.gather(*[router.generate(p, greedy | {"max_tokens": 16}) for p in short])  # measured
        calls.clear()
        alone = await router.generate(first, greedy | {"max_tokens": 4})
        streams = [router.generate_stream(p, greedy | {"max_tokens": 150}) for p in short]
        outs = [list((await s.__anext__())["token_ids"]) for s in streams]  # the two are decoding
        long_task = asyncio.ensure_future(router.generate(long_prompt, greedy | {"max_tokens": 4}))

        async def drain(i: int) -> None:
            async for chunk in streams[i]:
                outs[i] += chunk["token_ids"]

        await asyncio.gather(*[drain(i) for i in range(len(streams))])
        return alone, outs, await long_task

    alone, outs, long_out = asyncio.run(scenario())
    assert alone["token_ids"] == hf_greedy(tiny_pair.target, first, 4)
    assert long_out["token_ids"] == hf_greedy(tiny_pair.target, long_prompt, 4)
    for prompt, out in zip(short, outs, strict=True):
        assert out == hf_greedy(tiny_pair.target, prompt, 150)
    assert [n for n, _, _ in calls[:2]] == [256, 256], f"alone, the long prompt takes whole chunks: {calls}"
    beside = [(n, s) for n, s, chunk in calls[3:] if chunk]  # the second prompt's chunks, beside the streams
    # the streams' rounds once the prompt is in (their trees of 8-14 tokens, as beside the chunks)
    rounds = sorted(s for n, s, chunk in calls[3:] if not chunk and 8 <= n <= 14)
    sizes, seconds = [n for n, _ in beside], sorted(s for _, s in beside[3:])
    assert len(beside) >= 10 and max(sizes) <= 80, f"chunks sized to the streams' rounds, not 256: {sizes}"
    ratio = seconds[len(seconds) // 2] / rounds[len(rounds) // 2]  # 256-token chunks: 13x
    assert 1.4 <= ratio <= 2.6, f"a call carrying a chunk takes about twice a round ({ratio:.2f}x): {calls}"
    assert seconds[-1] <= 3.5 * rounds[len(rounds) // 2], f"never much more: {calls}"
