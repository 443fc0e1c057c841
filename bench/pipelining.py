"""Pipelining benchmark: the deployed app with and without micro-batch ping-pong, same models.

One run deploys the application on embedded Ray once per mode and drives it at each concurrency:
- plain: no drafter (the target alone, through the same router; gives T);
- sequential: draft, then verify, one micro-batch per lane;
- pipelined: ping-pong, the draft of one half overlapping the verify of the other.
For each it reports throughput (generated tokens/s over the wall time of the whole batch of
requests), the router's step time split into draft compute, target compute and overhead (time in
neither: Ray hops, serialization, Python; as a share of step time), tokens per step L, and the
zero-overhead bound of docs/design.md: tokens per round / (V + D) sequential, / max(V, D) pipelined.

Resources: the draft replica and the target shard get one CPU and one torch thread each, so the
two pools can overlap on a 2-core machine; the router and Ray take the remainder.

    python -m bench.pipelining                       # Qwen 1.5B target, 0.5B draft, bf16
    python -m bench.pipelining --tiny                # random tiny models: a smoke run in seconds
    python -m bench.pipelining --concurrency 1 4 16 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from ray import serve

from bench import apps, figures, report
from deploy.app import build_app
from deploy.config import AppConfig
from modelstore import resolve

NAME = "pipelining"
PROMPTS = [
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a short paragraph about why the sky is blue.",
    "Implement binary search in Python and explain its complexity.",
    "List the first ten prime numbers, one per line.",
    "Write a Python class for a stack with push, pop and peek.",
    "Explain what a hash table is to a beginner.",
    "Write a function that reverses a linked list in Python.",
    "Summarize the rules of chess in a few sentences.",
]
MODES = {"plain": ("none", False), "sequential": ("model", False), "pipelined": ("model", True)}


def prompts(target: str, n: int, tiny: bool) -> list[list[int]]:
    if tiny:
        gen = torch.Generator().manual_seed(0)
        return [torch.randint(3, 256, (8 + 3 * (i % 5),), generator=gen).tolist() for i in range(n)]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve(target))
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    chats = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
        for t in texts
    ]
    return [tok.encode(c, add_special_tokens=False) for c in chats]


def tiny_models(root: Path) -> tuple[str, str]:
    """A random Llama target and a noisy copy of it as draft (acceptance without pretrained weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4
    )
    target = LlamaForCausalLM(config).eval()
    target.save_pretrained(root / "target")
    with torch.no_grad():
        for p in target.parameters():
            p.add_(0.05 * p.std() * torch.randn_like(p)) if p.numel() > 1 else None
    target.save_pretrained(root / "draft")
    return str(root / "target"), str(root / "draft")


def app_config(args: argparse.Namespace, target: str, draft: str, mode: str) -> AppConfig:
    kind, pipelining = MODES[mode]
    return AppConfig.model_validate(
        {
            "target_model": target,
            "draft_model": draft,
            "dtype": args.dtype,
            "torch_threads": 1,
            "drafter": {"kind": kind},
            "speculation": {"max_depth": args.max_depth},
            "draft_pool": {"num_cpus": 1},
            "target_pool": {"shard_num_cpus": 1},
            "router_pool": {"num_cpus": 0.5, "router": {"pipelining": pipelining, "max_lane_sequences": 64}},
        }
    )


async def drive(handle: Any, batch: list[list[int]], max_tokens: int) -> tuple[float, int]:
    params = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
    start = time.perf_counter()
    results = await asyncio.gather(*[handle.generate.remote(p, params) for p in batch])
    return time.perf_counter() - start, sum(len(r["token_ids"]) for r in results)


def measure(args: argparse.Namespace, target: str, draft: str, mode: str, all_prompts: list[list[int]]) -> list[dict]:
    handle = serve.run(build_app(app_config(args, target, draft, mode)), name="bench", route_prefix=None)
    try:
        asyncio.run(drive(handle, all_prompts[:1], 4))  # warm-up: first forwards, caches, handles
        rows = []
        for c in args.concurrency:
            handle.stats.remote(reset=True).result()
            seconds, tokens = asyncio.run(drive(handle, all_prompts[:c], args.max_tokens))
            s = handle.stats.remote(reset=True).result()
            rows.append(
                {
                    "mode": mode,
                    "concurrency": c,
                    "tokens": tokens,
                    "seconds": seconds,
                    "tokens_per_s": tokens / seconds,
                    "step_s": s["step_s"],
                    "draft_s": s["draft_s"],
                    "verify_s": s["verify_s"],
                    "overhead_s": s["overhead_s"],
                    "overhead_share": s["overhead_share"],
                    "tokens_per_round": s["tokens"] / s["rounds"],
                }
            )
            print(f"{mode:>10} c={c:<3} {tokens / seconds:7.2f} tok/s  overhead {s['overhead_share']:.0%}", flush=True)
        return rows
    finally:
        serve.delete("bench")


def plot(rows: list[dict], stem: Path) -> None:
    fig, (left, right) = figures.figure(2, (11, 4))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    conc = sorted({r["concurrency"] for r in rows})
    by = {(r["mode"], r["concurrency"]): r for r in rows}
    groups = [f"c={c}" for c in conc]
    figures.grouped_bars(left, groups, {m: [by[m, c]["tokens_per_s"] for c in conc] for m in modes})
    figures.grouped_bars(right, groups, {m: [100 * by[m, c]["overhead_share"] for c in conc] for m in modes})
    for ax, title in ((left, "throughput (tokens/s)"), (right, "router overhead (% of step time)")):
        ax.set_title(title)
        ax.legend()
    figures.save(fig, stem.with_suffix(".png"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen-1.5b")
    parser.add_argument("--draft", default="qwen-0.5b")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tiny", action="store_true", help="random tiny models instead (smoke run)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-depth", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--render", metavar="JSON", help="only rewrite md/png from an earlier run's JSON")
    args = parser.parse_args()
    if args.render:
        summarize_and_write(*report.earlier_run(args.render))
        return
    tmp = tempfile.TemporaryDirectory()
    target, draft = tiny_models(Path(tmp.name)) if args.tiny else (args.target, args.draft)
    all_prompts = prompts(target, max(args.concurrency), args.tiny)
    try:
        with apps.local_serve(num_cpus=4):
            rows = [row for mode in args.modes for row in measure(args, target, draft, mode, all_prompts)]
    finally:
        tmp.cleanup()
    summarize_and_write(args, rows)


def summarize_and_write(args: argparse.Namespace, rows: list[dict], measured_on: dict[str, Any] | None = None) -> None:
    by = {(r["mode"], r["concurrency"]): r for r in rows}
    for r in rows:
        # Zero-overhead bound: the round's tokens over the time draft or target computed in it,
        # i.e. (V + D) when they ran one after the other, max(V, D) when they overlapped.
        r["bound_tokens_per_s"] = r["tokens_per_round"] / (r["step_s"] - r["overhead_s"])
        seq = by.get(("sequential", r["concurrency"]))
        plain = by.get(("plain", r["concurrency"]))
        r["speedup_vs_sequential"] = r["tokens_per_s"] / seq["tokens_per_s"] if seq else float("nan")
        r["speedup_vs_plain"] = r["tokens_per_s"] / plain["tokens_per_s"] if plain else float("nan")
    columns = ["mode", "c", "tok/s", "vs seq", "vs plain", "L/round", "step ms", "draft ms", "verify ms"]
    columns += ["overhead ms", "overhead %", "bound tok/s"]
    table = [
        [
            r["mode"],
            r["concurrency"],
            r["tokens_per_s"],
            r["speedup_vs_sequential"],
            r["speedup_vs_plain"],
            r["tokens_per_round"],
            1e3 * r["step_s"],
            1e3 * r["draft_s"],
            1e3 * r["verify_s"],
            1e3 * r["overhead_s"],
            100 * r["overhead_share"],
            r["bound_tokens_per_s"],
        ]
        for r in rows
    ]
    models = "tiny random Llama pair" if args.tiny else f"target {args.target}, draft {args.draft}"
    intro = (
        f"Models: {models}, {args.dtype}; {args.max_tokens} new tokens per request, greedy; max depth "
        f"{args.max_depth}. Draft replica and target shard: 1 CPU and 1 torch thread each.\n\n"
        "Step times are per router round (per lane): draft and verify are compute inside the workers; "
        "overhead is the part of the round in neither. The bound is tokens per round over the time of "
        "the round that draft or target computed ((V + D) one after the other, max(V, D) overlapped): "
        "what the round would yield with zero overhead. vs seq / vs plain: throughput ratios at the "
        "same concurrency.\n\n"
    )
    config = {k: v for k, v in vars(args).items()}
    markdown = intro + report.markdown_table(columns, table)
    stem = report.write(NAME, {"config": config, "rows": rows}, markdown, measured_on=measured_on)
    plot(rows, stem)
    print(stem.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
