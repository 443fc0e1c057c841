"""What padding would cost: a verify forward packed (the runner's) beside the same rows padded.

The runner packs every row's new tokens into one row (`speculative/engine/packing.py`). Before it did, a
forward padded its rows to the longest: the same forward over B rows of max(lengths) tokens each,
which this benchmark runs through the same runner to price it. Per batch size B it times, over a
cache of `--context` tokens per row: plain decoding (B x 1), some rows drafting k tokens beside
plain decodes, packed, and the same padded (every row at 1 + k).

    python -m bench.packing                       # Qwen 1.5B, bf16
    python -m bench.packing --model smollm2-135m --batches 4 --reps 2
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from bench import figures, report
from modelstore import fetch
from speculative.engine.loading import load_model
from speculative.engine.runner import ModelRunner, chain_parents

NAME = "packing"
RATIOS = (("packed_over_plain", "packed"), ("padded_over_plain", "padded"))  # (row key, plot label)


def timed_forward(runner: ModelRunner, lengths: list[int], reps: int) -> float:
    """Median seconds of one verify-shaped forward (logits at every new token), rolled back after each."""
    times = []
    for rep in range(reps + 1):
        tokens = [list(range(300, 300 + n)) for n in lengths]
        start = time.perf_counter()
        runner.forward(tokens, [chain_parents(n) for n in lengths], [list(range(n)) for n in lengths])
        if rep:  # the first is a warm-up for this shape
            times.append(time.perf_counter() - start)
        runner.commit([[] for _ in lengths])  # rolled back: nothing kept
    return sorted(times)[len(times) // 2]


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    model = load_model(str(fetch(args.model)), args.dtype).model
    rows = []
    for batch in args.batches:
        runner = ModelRunner(model)
        runner.add_rows([f"s{i}" for i in range(batch)])
        runner.extend([list(range(100, 100 + args.context)) for _ in range(batch)])
        drafting = max(batch // 4, 1)
        shapes = {
            "plain": [1] * batch,
            "packed": [1 + args.depth] * drafting + [1] * (batch - drafting),
            "padded": [1 + args.depth] * batch,
        }
        seconds = {name: timed_forward(runner, lengths, args.reps) for name, lengths in shapes.items()}
        row = {"batch": batch, "drafting_rows": drafting, "depth": args.depth}
        row |= {f"{name}_s": s for name, s in seconds.items()}
        row |= {"packed_over_plain": seconds["packed"] / seconds["plain"]}
        row |= {"padded_over_plain": seconds["padded"] / seconds["plain"]}
        print(row, flush=True)
        rows.append(row)
    return rows


def plot(rows: list[dict[str, Any]], stem: Path) -> None:
    fig, (ax,) = figures.figure()
    batches = [r["batch"] for r in rows]
    lines = {label: (batches, [r[key] for r in rows]) for key, label in RATIOS}
    figures.log2_lines(ax, lines, "rows in the forward (a quarter drafting)")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel("forward seconds / plain decode's")
    ax.legend()
    figures.save(fig, stem.with_suffix(".png"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen-1.5b")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--depth", type=int, default=4, help="draft tokens of each drafting row")
    parser.add_argument("--context", type=int, default=100, help="cached tokens per row")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    rows = measure(args)
    columns = ["B", "drafting rows", "plain s", "packed s", "padded s", "packed / plain", "padded / plain"]
    table = [
        [r["batch"], r["drafting_rows"], r["plain_s"], r["packed_s"], r["padded_s"]]
        + [r["packed_over_plain"], r["padded_over_plain"]]
        for r in rows
    ]
    intro = (
        f"{args.model}, {args.dtype}, {args.threads} torch threads; a cache of {args.context} tokens per row; "
        f"a quarter of the rows draft {args.depth} tokens (1 + {args.depth} in the forward), the rest decode "
        "plainly. packed: the runner's forward; padded: every row at the longest row's length (what a padded "
        f"forward computes). Median of {args.reps} forwards each, logits at every new token.\n\n"
    )
    stem = report.write(NAME, {"config": vars(args), "rows": rows}, intro + report.markdown_table(columns, table))
    plot(rows, stem)
    print(stem.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
