"""The decoder's own cost per step: a decoder step minus a bare forward of the same shapes.

With a tiny model a forward costs little, so what a step spends beyond it is the framework's:
building inputs and masks, the cache's bookkeeping, acceptance, commit, stop checks. Measured at
batch 1 and 32, plain (1 new token a row) and speculating (an oracle drafter's chain of k tokens a
row: k + 1 tokens a row verified, no draft model to time), on any machine:

    python -m bench.overhead                     # bench/results/overhead.{json,md,png}
    python -m bench.overhead --before old.json   # also shows an earlier run's figures beside these

Two figures per shape:
- overhead: the step minus a bare forward, the model's own forward (transformer stack and head)
  over [B, q] new tokens after a context of the same length, whichever of transformers' dynamic
  cache (bench.gpu.forward_cost.ForwardAtContext) and static cache is faster at that shape. The
  runner's packed attention can beat both (it folds grouped-query heads instead of repeating keys
  and values), and then the step is faster than the bare forward: the overhead reads negative.
- host: the step minus the time spent inside the model's calls during it (the same step's
  transformer stack and head): the decoder's own work around the model, never negative.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, cast

import torch
from transformers import StaticCache

from bench import figures, report
from bench.gpu.forward_cost import ForwardAtContext, timed
from bench.gpu.oracle import OracleDrafter
from bench.gpu.random_models import build_model
from speculative.decoder import SpeculativeDecoder
from speculative.drafters.base import Drafter
from speculative.engine.runner import ModelRunner
from speculative.planning.depth import DepthConfig
from speculative.rules.sampling import SamplingParams
from speculative.target import TargetVerifier

NAME = "overhead"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny-target", help="bench.gpu.random_models shape (default tiny-target)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--k", type=int, default=4, help="draft tokens a row when speculating")
    parser.add_argument("--acceptance", type=float, default=0.8, help="the oracle's per-token acceptance")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per row of the table")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (deploy/local.yaml runs 1)")
    parser.add_argument("--before", type=Path, help="an earlier run's JSON, shown beside this one")
    parser.add_argument("--before-label", default="an earlier run", help="what the earlier run measured (the md says)")
    parser.add_argument("--out", type=Path, default=report.RESULTS)
    return parser.parse_args()


class StaticForward:
    """One forward of q new tokens in each of `batch` rows after a context, through transformers'
    StaticCache, repeatable: the cache's lengths are set back to the context each call."""

    def __init__(self, model: Any, context: int, q: int, batch: int) -> None:
        gen = torch.Generator().manual_seed(0)
        vocab = int(model.config.vocab_size)
        self.model, self.context = model, context
        self.cache = StaticCache(config=model.config, max_cache_len=context + q)
        with torch.no_grad():
            model(input_ids=torch.randint(0, vocab, (batch, context), generator=gen), cache=self.cache, use_cache=True)
        self.ids = torch.randint(0, vocab, (batch, q), generator=gen)  # [B, q]
        self.positions = (context + torch.arange(q))[None].expand(batch, q)  # [B, q]

    @torch.no_grad()
    def __call__(self) -> torch.Tensor:  # [B, q, V]
        for layer in self.cache.layers:
            cast(Any, layer).cumulative_length.fill_(self.context)
        return self.model(input_ids=self.ids, position_ids=self.positions, cache=self.cache, use_cache=True).logits


class ModelClock:
    """Seconds spent inside a runner's model calls (transformer stack and head), summed."""

    def __init__(self, runner: ModelRunner) -> None:
        self.seconds = 0.0
        runner._base, runner._head = self._timed(runner._base), self._timed(runner._head)

    def _timed(self, call: Any) -> Any:
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed_call


def step_times(
    decoder: SpeculativeDecoder, clock: ModelClock, prompts: list[list[int]], params: SamplingParams, steps: int
) -> list[tuple[float, float]]:
    """(step, inside the model) seconds of `steps` decoder steps with every prompt running, after the
    prefill and 3 warm-up steps."""
    for p in prompts:
        decoder.add(p, params)
    for _ in range(4):
        decoder.step()
    times = []
    for _ in range(steps):
        clock.seconds = 0.0
        start = time.perf_counter()
        decoder.step()
        times.append((time.perf_counter() - start, clock.seconds))
        if len(decoder.active) != len(prompts):
            raise RuntimeError("a sequence finished while being timed: raise max_tokens")
    for seq_id in list(decoder.active):
        decoder.cancel(seq_id)
    return times


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    model = build_model(args.shape, "cpu", torch.float32)
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    max_tokens = 4 + (args.steps + 8) * (args.k + 1)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for batch in args.batches:
        prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(batch)]
        plain = SpeculativeDecoder(TargetVerifier(ModelRunner(model)), None, DepthConfig(max_depth=0))
        references = [p + s.output for p, s in zip(prompts, plain.generate(prompts, params), strict=True)]
        oracle = OracleDrafter(references, args.acceptance, vocab)
        for k, drafter in ((0, None), (args.k, oracle)):
            rows.append(one_row(model, prompts, params, batch, k, drafter, args))
            print(f"  {rows[-1]}", flush=True)
    return rows


def one_row(
    model: Any,
    prompts: list[list[int]],
    params: SamplingParams,
    batch: int,
    k: int,
    drafter: Drafter | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    depth = DepthConfig(max_depth=k, adaptive=False, load_adaptive=False)
    runner = ModelRunner(model)
    clock = ModelClock(runner)
    decoder = SpeculativeDecoder(TargetVerifier(runner), drafter, depth)
    times = step_times(decoder, clock, prompts, params, args.steps)
    step_ms = median([t for t, _ in times]) * 1e3
    host_ms = median([t - inside for t, inside in times]) * 1e3
    context = args.prompt_len + args.steps * (k + 1) // 2  # about the middle of the timed steps
    cpu = torch.device("cpu")
    dynamic_ms = timed(ForwardAtContext(model, context, k + 1, batch=batch), cpu, args.steps) * 1e3
    static_ms = timed(StaticForward(model, context, k + 1, batch), cpu, args.steps) * 1e3
    forward_ms = min(dynamic_ms, static_ms)
    return {
        "batch": batch,
        "draft_tokens": k,
        "step_ms": step_ms,
        "forward_dynamic_ms": dynamic_ms,
        "forward_static_ms": static_ms,
        "forward_ms": forward_ms,
        "overhead_ms": step_ms - forward_ms,
        "host_ms": host_ms,
    }


def markdown(rows: list[dict[str, Any]], before: list[dict[str, Any]] | None, args: argparse.Namespace) -> str:
    earlier = {(r["batch"], r["draft_tokens"]): r for r in before or []}
    columns = ["batch", "draft tokens a row", "step ms", "bare forward ms", "overhead ms", "host ms"]
    if before:
        columns += ["step ms before", "overhead ms before", "host ms before"]
    table = []
    for r in rows:
        line: list[Any] = [r["batch"], r["draft_tokens"], r["step_ms"], r["forward_ms"], r["overhead_ms"], r["host_ms"]]
        if before:
            old = earlier.get((r["batch"], r["draft_tokens"]))
            line += [old["step_ms"], old["overhead_ms"], old.get("host_ms", "-")] if old else ["-"] * 3
        table.append(line)
    intro = (
        f"Model `{args.shape}` (random weights, fp32, CPU, {args.threads} torch thread(s)), prompts of "
        f"{args.prompt_len} tokens, median of {args.steps} steps. Overhead = decoder step - bare forward of "
        f"the same [batch, draft tokens + 1] shape (the faster of transformers' dynamic and static caches); "
        f"host = decoder step - time inside the model's calls during it. Speculating rows use an oracle "
        f"drafter (acceptance {args.acceptance}), so no draft model is timed."
        + (f' Columns "before": {args.before_label}.' if before else "")
        + "\n\n"
    )
    return intro + report.markdown_table(columns, table)


def plot(rows: list[dict[str, Any]], before: list[dict[str, Any]] | None, stem: Path) -> None:
    fig, (ax,) = figures.figure()
    groups = [f"B={r['batch']} k={r['draft_tokens']}" for r in rows]
    series = {"overhead now": [r["overhead_ms"] for r in rows], "host now": [r["host_ms"] for r in rows]}
    if before:
        earlier = {(r["batch"], r["draft_tokens"]): r for r in before}
        old = [earlier.get((r["batch"], r["draft_tokens"]), {}) for r in rows]
        series = {
            "overhead before": [o.get("overhead_ms", 0.0) for o in old],
            "host before": [o.get("host_ms", 0.0) for o in old],
            **series,
        }
    figures.grouped_bars(ax, groups, series)
    ax.set_ylabel("ms per step beyond the forward")
    ax.legend()
    figures.save(fig, stem.with_suffix(".png"))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    before = json.loads(args.before.read_text())["rows"] if args.before else None
    rows = measure(args)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    stem = report.write(
        NAME, {"config": config, "rows": rows, "before": before}, markdown(rows, before, args), args.out
    )
    plot(rows, before, stem)
    print(f"wrote {stem}.json/.md/.png")


if __name__ == "__main__":
    main()
