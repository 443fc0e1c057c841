"""GPU benchmark with no downloads: Llama-3.1-8B / Llama-3.2-1B shapes, random weights, oracle drafts.

Sections, each under its own time budget, each wrapped so that a failure prints its error and
the rest still runs; results are written after every section, so a timeout still returns data:
- bound: the batch-1 bandwidth bound, bandwidth (the GPU's specification, else a measured copy)
  over the target's weight bytes (bench/gpu/bandwidth.py), and a headline against it;
- served: the served application (router, draft pool, target pool on a local Ray) with real draft
  models agreeing with the target on a set share of tokens (bench/gpu/served.py);
- target: the target alone, batch 1 (T per token) and the references the oracle follows;
- oracle: speculation with an oracle draft of set acceptance over a grid of (acceptance, k):
  L, V, D, measured speedup, bound L*T/(V+D) and efficiency = speedup / bound;
- verify: one target forward over q = 1..32 new tokens, eager and (CUDA) replayed as a CUDA
  graph, with the graph's logits checked against eager;
- draft: the 1B draft's forward cost and its real drafting cost D(k) in our decoder, and the
  bound a real 1B draft would reach at the oracle's acceptance rates;
- batch: target alone vs oracle speculation at batch sizes B (throughput), through the runner's
  slot KV cache (speculative/engine/kv_cache.py) like every section;
- tp: NCCL tensor parallelism needs 2+ GPUs; skipped with a note on one.

    python -m bench.gpu --out DIR            # on a CUDA machine: bf16, the real shapes (~3-5 min)
    python -m bench.gpu --tiny --out DIR     # anywhere: tiny shapes on CPU, the very same code
"""

from __future__ import annotations

import argparse
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import report
from bench.gpu import sections as sec
from bench.gpu.bandwidth import bound_section
from bench.gpu.random_models import build_model, confident_init
from bench.gpu.report import markdown, plot
from bench.gpu.served import section as served_section

NAME = "gpu"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=report.RESULTS, help="folder for gpu.json / .md / .png")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (checks every code path)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="default bf16 (tiny: fp32)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting new work after this")
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=4, help="single-stream prompts")
    parser.add_argument("--acceptances", default="0.6,0.8,0.9")
    parser.add_argument("--ks", default="2,4,6")
    parser.add_argument("--batches", default=None, help="batch sizes for the throughput section")
    parser.add_argument("--only-batch", action="store_true", help="run the throughput-by-batch section alone")
    parser.add_argument("--no-served", dest="served", action="store_false", help="skip the served application")
    parser.add_argument("--agreement", type=float, default=0.8, help="served drafts' agreement with the target")
    parser.add_argument("--served-batch", type=int, default=None, help="concurrent requests of the served batch row")
    parser.add_argument(
        "--context",
        type=float,
        default=0.25,
        help="random_models.confident_init's context size: large values leave bf16 near-ties that flip between "
        "1-token and multi-token forwards (outputs stop being exact); 0.25 keeps them apart",
    )
    args = parser.parse_args()
    tiny = args.tiny
    args.dtype = args.dtype or ("float32" if tiny else "bfloat16")
    args.prompt_len = args.prompt_len or (16 if tiny else 128)
    args.new_tokens = args.new_tokens or (24 if tiny else 128)
    args.batches = args.batches or ("2,4" if tiny else "8,32")
    args.served_batch = args.served_batch or (4 if tiny else 32)
    return args


def build(args: argparse.Namespace) -> tuple[sec.Bench, dict[str, Any]]:
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny, or on a GPU machine")
    dtype = getattr(torch, args.dtype)
    shapes = ("tiny-target", "tiny-draft") if args.tiny else ("llama-8b", "llama-1b")
    start = time.perf_counter()
    target = confident_init(build_model(shapes[0], device, dtype, seed=0), args.context, seed=0)
    draft = confident_init(build_model(shapes[1], device, dtype, seed=1), args.context, seed=1)
    bench = sec.Bench(
        target=target,
        draft=draft,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        prompts=args.prompts,
        reps=5 if args.tiny else 20,
        graphs="cuda" if device == "cuda" else "dry",
    )
    sec.sync(bench.device)
    info = {
        "shapes": shapes,
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "graphs": bench.graphs,
        "build_s": time.perf_counter() - start,
        "params_target": sum(p.numel() for p in target.parameters()),
        "params_draft": sum(p.numel() for p in draft.parameters()),
    }
    if device == "cuda":
        info["memory_gib"] = torch.cuda.memory_allocated() / 2**30
    print(f"built {info}", flush=True)
    return bench, info


class Sections:
    """Runs sections in order, keeps their results, writes everything after each one."""

    def __init__(self, args: argparse.Namespace, setup: dict[str, Any]) -> None:
        self.args = args
        self.results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "setup": setup}
        self.deadline = time.monotonic() + args.budget_s

    def run(self, name: str, share: float, fn: Callable[[float], Any]) -> Any:
        """`share`: the fraction of the remaining budget this section may start work in."""
        start = time.monotonic()
        deadline = start + share * max(self.deadline - start, 0.0)
        print(f"== {name} (budget {deadline - start:.0f} s)", flush=True)
        try:
            value = fn(deadline)
            self.results[name] = value
        except Exception as error:  # one failing section must not lose the others
            traceback.print_exc()
            value = None
            self.results[name] = {"error": f"{type(error).__name__}: {error}"}
        self.results.setdefault("seconds", {})[name] = time.monotonic() - start
        self.write()
        return value

    def write(self) -> None:
        stem = report.write(NAME, self.results, markdown(self.results), folder=self.args.out)
        try:
            plot(self.results, f"{stem}.png")
        except Exception as error:
            print(f"plot failed: {type(error).__name__}: {error}", flush=True)


def tensor_parallel_note() -> dict[str, Any]:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    note = "needs 2+ GPUs (NCCL) and the actors' DeepSpeed/Ray path; not measured here"
    return {"gpus": count, "skipped": note if count < 2 else "2+ GPUs present, but this script does not run TP"}


def main() -> None:
    args = parse_args()
    total = time.monotonic()
    bench, setup = build(args)
    sections = Sections(args, setup)
    prompts = bench.make_prompts(args.prompts, seed=0)
    grid = [(float(a), int(k)) for a in args.acceptances.split(",") for k in args.ks.split(",")]
    refs: list[list[int]] = []

    def target(_deadline: float) -> dict[str, Any]:
        row, outputs = sec.target_alone(bench, prompts)
        row["context_share"] = sec.context_share(bench.target, outputs, args.prompt_len)
        refs.extend(outputs)
        return row

    bound = sections.run("bound", 1.0, lambda _d: bound_section(bench.target)) or {}
    if args.served:
        sections.run(
            "served",
            0.5,
            lambda d: served_section(bench, bound.get("bound_tokens_per_s"), args.agreement, 4, args.served_batch, d),
        )
    if not args.only_batch:
        row = sections.run("target", 0.15, target)
        if row is None:
            raise SystemExit("the target alone failed: nothing else can be measured")
        t = row["T_ms"] / 1e3
        oracle = sections.run("oracle", 0.45, lambda d: sec.oracle_grid(bench, prompts, refs, grid, d)) or []
        verify = sections.run("verify", 0.2, lambda d: sec.verify_cost(bench, [1, 2, 3, 4, 5, 7, 8, 16, 32], d))
        sections.run("projected", 1.0, lambda _d: sec.projected(oracle, verify or []))
        sections.run("draft", 0.3, lambda d: sec.draft_cost(bench, prompts, oracle, t, d))
    batches = [int(b) for b in args.batches.split(",")]
    sections.run("batch", 0.9, lambda d: sec.batched(bench, batches, 0.8, 4, d))
    sections.run("tp", 1.0, lambda _d: tensor_parallel_note())
    sections.results["total_s"] = time.monotonic() - total
    sections.write()
    print(markdown(sections.results), flush=True)
    print(f"total {sections.results['total_s']:.0f} s; results in {args.out}", flush=True)


if __name__ == "__main__":
    main()
