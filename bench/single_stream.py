"""Single-stream benchmark on the Qwen pair: target alone, our drafters, and HF assisted generation.

One process, same prompts, same machine, each method in turn per dtype:
- target: HF `generate(do_sample=False)` with the target alone (the reference output and T);
- plain: our decoder with no drafter (our own overhead over HF);
- chain / tree / lookup / hybrid: our speculative decoder with the draft model or prompt lookup;
- medusa / eagle: our decoder with the heads `make heads` trained for the target (in $SPECSERVE_HEADS;
  left out, with a note, where they are not there);
- hf-assisted: HF `generate(assistant_model=draft)`, its default schedule.
Reports tokens/s, acceptance length L (tokens per target step), speedup over the target alone, the
analytic bound L*T/(V+D) of docs/design.md (T: target decode step, V: our verify step, D: our draft
round, all measured in this run), and whether each prompt's output equals the target's greedy one.

    python -m bench.single_stream [--dtypes bfloat16,float32] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import figures, report
from deploy.local.decoder import LocalModels
from speculative.drafters.config import DrafterConfig, drafter_config
from speculative.planning.costs import StepCosts
from speculative.planning.depth import DepthConfig
from speculative.rules.sampling import SamplingParams

NAME = "single_stream"
PROMPTS = {
    "code": "Write a Python function that merges two sorted lists into one sorted list.",
    "prose": "Write a short paragraph about why the sky is blue.",
    "list": "List the first ten prime numbers, one per line, with a short note on each.",
    "chat": "Hi! Can you recommend a good way to learn a new programming language?",
    "code-edit": (
        "Rename the function `calc` to `total_price` and change nothing else:\n\n"
        "def calc(items, tax):\n    subtotal = 0\n    for item in items:\n        subtotal += item.price * item.qty\n"
        "    discount = 0.1 * subtotal if subtotal > 100 else 0\n    return (subtotal - discount) * (1 + tax)\n"
    ),
}
OURS = {
    "plain": drafter_config(kind="none"),
    "chain": drafter_config(kind="model"),
    "tree": drafter_config(kind="model", tree_width=2, tree_nodes=6),
    "lookup": drafter_config(kind="lookup"),
    "hybrid": drafter_config(kind="hybrid"),
}


def run_ours(
    models: LocalModels, config: DrafterConfig, prompt: list[int], n: int, depth: int, costs: StepCosts
) -> dict[str, Any]:
    """Greedy, stopping at the target's end-of-sequence tokens as HF generate does; depths capped by the
    verify and draft costs measured so far in this run (`costs`, shared by a method's prompts)."""
    draft_cost = 0.4 if config.needs_draft_model else 0.0  # lookup, heads: no draft forward
    decoder = models.decoder(config, DepthConfig(max_depth=depth, draft_cost=draft_cost), costs)
    start = time.perf_counter()
    (seq,) = decoder.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n))
    elapsed = time.perf_counter() - start
    t = decoder.times
    return {
        "tokens": seq.output,
        "seconds": elapsed,
        "steps": seq.stats.steps,
        "acceptance_length": seq.stats.acceptance_length,
        "verify_s": t.verify / max(t.steps, 1),
        "draft_s": t.draft / max(t.steps, 1),
    }


def run_hf(models: LocalModels, prompt: list[int], n: int, assisted: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"assistant_model": models.draft.model} if assisted and models.draft else {}
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    target: Any = models.target.model
    with torch.no_grad():
        # Stop at the end-of-sequence token as ours does: min_new_tokens would mask EOS and change the text.
        out = target.generate(ids, do_sample=False, max_new_tokens=n, pad_token_id=0, **kwargs)
    return {"tokens": out[0, len(prompt) :].tolist(), "seconds": time.perf_counter() - start}


def head_drafters(target: str, folder: Path) -> dict[str, DrafterConfig]:
    """Medusa and EAGLE drafters over the heads trained for `target` in `folder` (`make heads`), those present."""
    out = {}
    for kind, field in (("medusa", "medusa_heads"), ("eagle", "eagle_head")):
        heads = folder / f"{target}-{kind}"
        if not (heads / "config.json").exists():
            print(f"no {kind} heads in {heads} (make heads): left out", flush=True)
            continue
        out[kind] = drafter_config({"kind": kind, field: str(heads)})
    return out


def bench_dtype(dtype: str, n: int, depth: int, target: str, draft: str, heads: Path) -> list[dict[str, Any]]:
    models = LocalModels.load(target, draft, dtype)
    prompts = {k: models.chat_prompt(v) for k, v in PROMPTS.items()}
    ours_configs = {**OURS, **head_drafters(target, heads)}

    def ours(config: DrafterConfig) -> Callable[[list[int], int], dict[str, Any]]:
        costs = StepCosts()
        return lambda p, k: run_ours(models, config, p, k, depth, costs)

    methods: dict[str, Callable[[list[int], int], dict[str, Any]]] = {
        "target": lambda p, k: run_hf(models, p, k, assisted=False),
        **{name: ours(config) for name, config in ours_configs.items()},
        "hf-assisted": lambda p, k: run_hf(models, p, k, assisted=True),
    }
    warm = models.chat_prompt("Hello")
    for fn in methods.values():  # warm-up: first-call allocations and kernel selection
        fn(warm, 8)
    rows = []
    reference: dict[str, list[int]] = {}
    for method, fn in methods.items():
        for kind, prompt in prompts.items():
            result = fn(prompt, n)
            if method == "target":
                reference[kind] = result["tokens"]
            result.update(dtype=dtype, method=method, prompt=kind, exact=result["tokens"] == reference[kind])
            rows.append(result)
            print(
                f"{dtype:9s} {method:12s} {kind:10s} {len(result['tokens']) / result['seconds']:6.2f} tok/s "
                f"exact={result['exact']}",
                flush=True,
            )
    return rows


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        base = [r for r in rows if r["dtype"] == dtype and r["method"] == "target"]
        target_step = sum(r["seconds"] for r in base) / sum(len(r["tokens"]) for r in base)  # T
        for method in dict.fromkeys(r["method"] for r in rows):
            rs = [r for r in rows if r["dtype"] == dtype and r["method"] == method]
            tokens = sum(len(r["tokens"]) for r in rs)
            seconds = sum(r["seconds"] for r in rs)
            entry: dict[str, Any] = {
                "dtype": dtype,
                "method": method,
                "tokens_per_s": tokens / seconds,
                "speedup": (tokens / seconds) * target_step,
                "exact_prompts": f"{sum(r['exact'] for r in rs)}/{len(rs)}",
            }
            if "steps" in rs[0]:
                steps = sum(r["steps"] for r in rs)
                length = tokens / steps
                verify = sum(r["verify_s"] * r["steps"] for r in rs) / steps
                draft = sum(r["draft_s"] * r["steps"] for r in rs) / steps
                bound = length * target_step / (verify + draft)
                entry.update(
                    acceptance_length=length,
                    verify_ms=verify * 1e3,
                    draft_ms=draft * 1e3,
                    bound=bound,
                    efficiency=entry["speedup"] / bound,
                )
            out.append(entry)
    return out


def by_prompt(rows: list[dict[str, Any]]) -> list[list[Any]]:
    """Speedup over the target alone per prompt: one row per dtype and method, one column per prompt
    (with the acceptance length where the method has one), e.g. prompt lookup on code editing."""
    table = []
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        base = {r["prompt"]: r for r in rows if r["dtype"] == dtype and r["method"] == "target"}
        for method in dict.fromkeys(r["method"] for r in rows if r["method"] != "target"):
            cells: list[Any] = [dtype, method]
            for r in (r for r in rows if r["dtype"] == dtype and r["method"] == method):
                t = base[r["prompt"]]
                speedup = (len(r["tokens"]) / r["seconds"]) / (len(t["tokens"]) / t["seconds"])
                length = f" (L {r['acceptance_length']:.2f})" if "acceptance_length" in r else ""
                cells.append(f"{speedup:.2f}{length}")
            table.append(cells)
    return table


def plot(summary: list[dict[str, Any]], path: str) -> None:
    dtypes = list(dict.fromkeys(s["dtype"] for s in summary))
    methods = list(dict.fromkeys(s["method"] for s in summary))
    by = {(s["dtype"], s["method"]): s for s in summary}
    fig, (ax,) = figures.figure(size=(9, 4.5))
    series = {f"{d} measured": [by[d, m]["speedup"] for m in methods] for d in dtypes}
    xs = figures.grouped_bars(ax, methods, series)
    for i, dtype in enumerate(dtypes):
        pairs = zip(xs[f"{dtype} measured"], methods, strict=True)
        bounded = [(x, by[dtype, m]["bound"]) for x, m in pairs if "bound" in by[dtype, m]]
        label = "analytic bound" if i == 0 else None
        ax.scatter([x for x, _ in bounded], [b for _, b in bounded], marker="_", s=400, c="k", label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("speedup over target alone")
    ax.set_title("Single stream, Qwen2.5-Coder 1.5B target / 0.5B draft, greedy")
    ax.legend()
    figures.save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--max-depth", type=int, default=4)
    parser.add_argument("--target", default="qwen-1.5b")
    parser.add_argument("--draft", default="qwen-0.5b")
    parser.add_argument(
        "--heads", default=os.environ.get("SPECSERVE_HEADS", "~/.cache/specserve/heads"), help="`make heads`' folder"
    )
    args = parser.parse_args()
    rows = []
    for dtype in args.dtypes.split(","):
        rows += bench_dtype(
            dtype, args.new_tokens, args.max_depth, args.target, args.draft, Path(args.heads).expanduser()
        )
    summary = summarise(rows)
    columns = [
        "dtype",
        "method",
        "tokens/s",
        "speedup",
        "accept len",
        "verify ms",
        "draft ms",
        "bound",
        "efficiency",
        "exact",
    ]
    table = [
        [
            s["dtype"],
            s["method"],
            s["tokens_per_s"],
            s["speedup"],
            s.get("acceptance_length", "-"),
            s.get("verify_ms", "-"),
            s.get("draft_ms", "-"),
            s.get("bound", "-"),
            s.get("efficiency", "-"),
            s["exact_prompts"],
        ]
        for s in summary
    ]
    notes = (
        f"{len(PROMPTS)} prompts ({', '.join(PROMPTS)}), {args.new_tokens} new tokens each, greedy, batch 1. "
        "speedup = tokens/s over the target alone (HF generate) in the same run; bound = L*T/(V+D) "
        "(docs/design.md); efficiency = speedup / bound; exact = prompts whose output equals the target's own "
        "greedy output.\n\n"
    )
    stem = report.write(
        NAME,
        {"args": vars(args), "summary": summary, "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]},
        notes
        + report.markdown_table(columns, table)
        + "\n\nSpeedup over the target alone by prompt (acceptance length L):\n\n"
        + report.markdown_table(["dtype", "method", *PROMPTS], by_prompt(rows))
        + f"\n\n![speedup]({NAME}.png)",
    )
    plot(summary, f"{stem}.png")
    print(report.markdown_table(columns, table))


if __name__ == "__main__":
    main()
