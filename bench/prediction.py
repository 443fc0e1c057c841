"""Predicted Outputs on the shipped `deploy/local.yaml` unchanged (but for the port): code edits with and without
a `prediction`, side by side in one run.

A prediction is text the output is expected to repeat; prompt lookup drafts from it as from the context
(deploy/openai/api.py `prediction`, speculative/drafters/lookup.py `searched`), so it changes no token, only
how many a target forward commits. Three code edits, each streamed alone (c = 1), greedy, with the official
`openai` client, with and without the prediction in turn (order reversed each pass):
- regenerate: a function written from its description, after the description changed in one clause; the
  prediction is the model's answer to the description before the change (asked first, in this run), as an
  editor sends the file it has when a small change asks for it again; the prompt holds no code;
- hints: type hints and a docstring for a function in the prompt, after the function changed in one line;
  the prediction the answer for the function before the change (the prompt's code is quoted by lookup
  already without it);
- rename: a function renamed in a file, the prediction the file as it is (OpenAI's own example); the prompt
  holds the same text, which lookup quotes already without the prediction.
Reports tokens/s, the ratio with / without, acceptance length, `accepted_prediction_tokens`, and whether the
texts are the same.

    python -m bench.prediction    # ~5 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import functools
import statistics
from pathlib import Path
from typing import Any

from bench import apps, figures, report
from deploy.local.demo import Streamed, deploy_local, start_local_ray, stop_local_ray, stream_chat

NAME = "prediction"
BEFORE = """def summarize(orders, min_total):
    totals = {}
    for order in orders:
        customer = order["customer"]
        totals[customer] = totals.get(customer, 0) + order["amount"]
    big = [c for c, t in totals.items() if t >= min_total]
    big.sort(key=lambda c: -totals[c])
    lines = [f"{c}: {totals[c]:.2f}" for c in big]
    return "\\n".join(lines)
"""
AFTER = BEFORE.replace('order["amount"]', 'order["amount"] * order.get("quantity", 1)')
SPEC = (
    "Write a Python function `summarize(orders, min_total)` with type hints and a docstring. `orders` is a list of "
    "dicts with keys 'customer' and 'amount'{}. Total the {} per customer, keep the customers whose total is at "
    "least `min_total`, sort them by total, largest first, and return one line per customer, 'name: total' with "
    "two decimals, joined by newlines. Reply with the code only."
)
SPEC_BEFORE = SPEC.format("", "amounts")
SPEC_AFTER = SPEC.format(" and an optional 'quantity' (default 1)", "amount times quantity")
HINTS = "Add type hints and a one-line docstring to this function. Reply with the code only.\n\n```python\n{}```"
RENAME = "Rename the function `summarize` to `report_big_customers` and change nothing else.\n\n```python\n{}```"


def main() -> None:
    args = apps.served_parser(__doc__, max_tokens=256, port=8124).parse_args()
    shipped = apps.shipped(args.config)
    model = apps.served_name(shipped)
    start_local_ray(shipped)
    try:
        url = deploy_local(shipped, args.port)
        chat = functools.partial(stream_chat, url, model, speculate=True, show=False)
        chat(HINTS.format(BEFORE), 8)  # warm-up: first forwards, kernels, connections
        earlier_spec, earlier_hints = (chat(p, args.max_tokens).text for p in (SPEC_BEFORE, HINTS.format(BEFORE)))
        cases = {
            "regenerate": (SPEC_AFTER, earlier_spec),
            "hints": (HINTS.format(AFTER), earlier_hints),
            "rename": (RENAME.format(AFTER), AFTER),
        }
        runs: dict[str, dict[str, list[Streamed]]] = {c: {"with": [], "without": []} for c in cases}
        for rep in range(args.repeats):
            for case, (prompt, prediction) in cases.items():
                for mode in ("with", "without") if rep % 2 == 0 else ("without", "with"):
                    run = chat(prompt, args.max_tokens, prediction=prediction if mode == "with" else None)
                    runs[case][mode].append(run)
                    print(f"  pass {rep + 1} {case:>10} {mode:>7}: {run.rate:.2f} tok/s", flush=True)
    finally:
        stop_local_ray()
    write(args, runs, {c: p for c, (_, p) in cases.items()})


def _rate(runs: list[Streamed]) -> float:
    return sum(r.tokens for r in runs) / sum(r.seconds for r in runs)


def _decode_rate(runs: list[Streamed]) -> float:
    """Tokens after the first over the seconds after it: the pace once the prompt is in."""
    return sum(r.tokens - 1 for r in runs) / sum(r.seconds - r.first_token_s for r in runs)


def write(args: argparse.Namespace, runs: dict[str, dict[str, list[Streamed]]], predictions: dict[str, str]) -> None:
    rows = []
    for case, modes in runs.items():
        without, decode_without = _rate(modes["without"]), _decode_rate(modes["without"])
        same = all(r.text == modes["without"][0].text for m in modes.values() for r in m)
        for mode, mine in modes.items():
            accepted, rejected = mine[0].predicted or (None, None)
            length = statistics.fmean(r.acceptance_length for r in mine)
            decode = _decode_rate(mine)
            rows.append(
                [mode, case, _rate(mine), _rate(mine) / without, decode, decode / decode_without, length]
                + [mine[0].tokens, accepted, rejected, same]
            )
    summary: dict[str, Any] = {}
    for case, m in runs.items():
        summary[f"{case}_with_vs_without"] = _rate(m["with"]) / _rate(m["without"])
        summary[f"{case}_decode_with_vs_without"] = _decode_rate(m["with"]) / _decode_rate(m["without"])
    summary["same_text_everywhere"] = all(row[-1] for row in rows)
    columns = [
        "prediction",
        "edit",
        "tok/s",
        "vs without",
        "decode tok/s",
        "decode vs without",
        "L",
        "tokens",
        "accepted_prediction",
        "rejected_prediction",
        "same text",
    ]
    intro = (
        f"`{Path(args.config).name}` unchanged (the port aside): Qwen2.5-Coder 1.5B target, 0.5B draft. Each edit "
        f"streamed alone (c = 1), greedy, up to {args.max_tokens} tokens, with the `openai` client over HTTP, "
        f"{args.repeats} passes (with and without the prediction in turn, order reversed each pass). regenerate: a "
        "function from its description after the description changed in one clause, the prediction the answer "
        "to the description before (asked first in this run; no code in the prompt); hints: type hints and a "
        "docstring for a function changed in one line, the prediction the answer for the function before the "
        "change (the prompt's code quoted by lookup either way); rename: a rename, the prediction the file as it "
        "is (also in the prompt). tok/s: end to end, the prompt's prefill included; decode tok/s: after the first "
        "token. L: acceptance length (tokens per target forward); accepted / rejected: "
        "`usage.completion_tokens_details` of the first pass; same text: every run's text equal.\n\n"
        + report.summary_table(summary)
    )
    data = {
        "config": vars(args),
        "summary": summary,
        "rows": [dict(zip(columns, r, strict=True)) for r in rows],
        "predictions": predictions,
        "texts": {case: m["without"][0].text for case, m in runs.items()},
    }
    stem = report.write(NAME, data, intro + report.markdown_table(columns, rows) + f"\n\n![rates]({NAME}.png)")
    figures.mode_bars(rows, stem.with_suffix(".png"), "Predicted Outputs on deploy/local.yaml: code edits")
    print(stem.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
