"""What one Linear costs by rows of input, per CPU kernel: why `dtype: auto` and `cpu_linear: onednn`.

One 1536x8960 Linear (a Qwen 1.5B MLP matrix), random weights, on `--threads` torch threads, timed at
each row count with torch's bfloat16 and float32 kernels and with the weight prepacked for oneDNN
(`speculative/engine/cpu/onednn_linear.py`: float32, and bfloat16 where oneDNN computes it natively), all in one run.
The matrix (27 MB in bfloat16) stays in a large last-level cache between calls, so these times show the
kernels' own work, not a whole model's weight reads. A verify of k draft tokens is a forward of
1 + k rows, a decode step one row: the ratio to the 1-row float32 call is what speculation pays.

    python -m bench.cpu_linear               # ~1 minute
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from bench import figures, report
from speculative.engine.cpu.onednn_linear import PackedLinear, native_bf16

NAME = "cpu_linear"
BF16_PACKED = native_bf16("cpu")  # bfloat16 layers are `cpu_linear.packable` here
KERNELS = ("bfloat16", "float32", "float32 oneDNN packed") + (("bfloat16 oneDNN packed",) if BF16_PACKED else ())


def seconds(f: Any, reps: int) -> float:
    """Median seconds of `reps` calls of f (after one warm-up call)."""
    f()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    linear = torch.nn.Linear(args.inputs, args.outputs, bias=False)
    half = torch.nn.Linear(args.inputs, args.outputs, bias=False).to(torch.bfloat16)
    layers: dict[str, torch.nn.Module] = {"bfloat16": half, "float32": linear}
    layers["float32 oneDNN packed"] = PackedLinear(linear)
    if BF16_PACKED:
        layers["bfloat16 oneDNN packed"] = PackedLinear(half)
    rows = []
    with torch.inference_mode():
        for n in args.rows:
            x = torch.randn(n, args.inputs)
            row: dict[str, Any] = {"rows": n}
            for kernel, layer in layers.items():
                inp = x.to(torch.bfloat16) if kernel.startswith("bfloat16") else x
                row[f"{kernel}_ms"] = 1e3 * seconds(lambda layer=layer, inp=inp: layer(inp), args.reps)
            print(row, flush=True)
            rows.append(row)
    one = rows[0]["float32_ms"] if rows[0]["rows"] == 1 else None
    for row in rows:
        row |= {f"{k}_over_float32_1row": row[f"{k}_ms"] / one for k in KERNELS} if one else {}
    return rows


def plot(rows: list[dict[str, Any]], stem: Path) -> None:
    fig, (ax,) = figures.figure()
    ns = [r["rows"] for r in rows]
    figures.log2_lines(ax, {k: (ns, [r[f"{k}_ms"] for r in rows]) for k in KERNELS}, "rows of input")
    ax.set_ylabel("ms per call")
    ax.legend()
    figures.save(fig, stem.with_suffix(".png"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (deploy/local.yaml runs 1)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 9, 32])
    parser.add_argument("--inputs", type=int, default=1536)
    parser.add_argument("--outputs", type=int, default=8960)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    rows = measure(args)
    columns = ["rows", *(f"{k} ms" for k in KERNELS), *(f"{k} / float32 1 row" for k in KERNELS)]
    table = [
        [r["rows"], *(r[f"{k}_ms"] for k in KERNELS), *(r.get(f"{k}_over_float32_1row") for k in KERNELS)] for r in rows
    ]
    intro = (
        f"One {args.inputs}x{args.outputs} Linear, {args.threads} torch thread(s), median of {args.reps} calls; "
        f"bf16 support in oneDNN here: {BF16_PACKED}.\n\n"
    )
    stem = report.write(NAME, {"config": vars(args), "rows": rows}, intro + report.markdown_table(columns, table))
    plot(rows, stem)
    print(stem.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
