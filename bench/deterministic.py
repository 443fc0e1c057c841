"""What batch-invariant target forwards cost, and what they give, on the shipped `deploy/local.yaml`.

One run deploys the application twice side by side behind Serve's HTTP proxy: the YAML as shipped
(`target_pool.deterministic: auto`, on for its bfloat16 CPU target) and the same YAML with
`target_pool.deterministic: off` (the libraries' kernels, as before). Each prompt is streamed alone
(c = 1) with the official `openai` client, greedy, in four modes per pass (their order reversed each
pass): speculation and plain decoding (`max_draft_tokens: 0`) on each deployment. It reports tokens/s
per mode, the ratios deterministic / library kernels, and on each deployment how many prompts
speculation answers with plain decoding's text.

    python -m bench.deterministic                  # ~12 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench import apps, figures, report
from bench.round_ahead import PROMPTS as CODE_PROMPTS
from deploy.local.demo import Streamed, deploy_local, start_local_ray, stop_local_ray

NAME = "deterministic"
PROMPTS = {
    **CODE_PROMPTS,
    "prose": "Explain in a short paragraph why the sky is blue.",
    "list": "List five uses of a hash map, one line each.",
}
MODES = {  # mode -> (deployment, speculate)
    "deterministic, speculation": ("deterministic", True),
    "deterministic, plain": ("deterministic", False),
    "library kernels, speculation": ("library", True),
    "library kernels, plain": ("library", False),
}
Runs = apps.Runs


def _rate(runs: list[Streamed]) -> float:
    return sum(r.tokens for r in runs) / sum(r.seconds for r in runs)


def _same_texts(runs: Runs, app: str) -> int:
    """Streams of `app` whose speculative text is its plain text (pass by pass, prompt by prompt)."""
    spec, plain = runs[f"{app}, speculation"], runs[f"{app}, plain"]
    return sum(s.text == p.text for a, b in zip(spec, plain, strict=True) for s, p in zip(a, b, strict=True))


def write(args: argparse.Namespace, runs: Runs) -> None:
    rows = [[mode, prompt, _rate(runs[mode][i])] for i, prompt in enumerate(PROMPTS) for mode in MODES]

    def total(mode: str) -> float:
        return _rate([r for per_prompt in runs[mode] for r in per_prompt])

    streams = len(PROMPTS) * args.repeats
    summary: dict[str, Any] = {
        "speculation_deterministic_vs_library": total("deterministic, speculation")
        / total("library kernels, speculation"),
        "plain_deterministic_vs_library": total("deterministic, plain") / total("library kernels, plain"),
        "speculation_vs_plain_deterministic": total("deterministic, speculation") / total("deterministic, plain"),
        "speculation_vs_plain_library": total("library kernels, speculation") / total("library kernels, plain"),
        "same_text_deterministic": f"{_same_texts(runs, 'deterministic')}/{streams}",
        "same_text_library": f"{_same_texts(runs, 'library kernels')}/{streams}",
    }
    columns = ["mode", "prompt", "tok/s"]
    intro = (
        f"`{Path(args.config).name}` unchanged (the port and route aside), and the same YAML with "
        "`target_pool.deterministic: off` deployed beside it: Qwen2.5-Coder 1.5B target (bfloat16), 0.5B draft. "
        f"Each prompt streamed alone (c = 1), {args.max_tokens} new tokens, greedy, with the `openai` client over "
        f"HTTP, {args.repeats} passes (modes in turn per prompt, their order reversed each pass). plain: "
        "`max_draft_tokens: 0` on the same deployment. same_text: streams whose speculative text equals the "
        "plain text of the same pass.\n\n" + report.summary_table(summary)
    )
    data = {"config": vars(args), "summary": summary, "rows": [dict(zip(columns, r, strict=True)) for r in rows]}
    stem = report.write(NAME, data, intro + report.markdown_table(columns, rows) + f"\n\n![rates]({NAME}.png)")
    figures.mode_bars(rows, stem.with_suffix(".png"), "batch-invariant target forwards on deploy/local.yaml")
    print(stem.with_suffix(".md").read_text())


def main() -> None:
    parser = apps.served_parser(__doc__, max_tokens=64, port=8125)
    args = parser.parse_args()
    shipped = apps.shipped(args.config)
    library = apps.variant(shipped, {"target_pool": {"deterministic": "off"}})
    model = apps.served_name(shipped)
    start_local_ray(shipped, apps=2)
    try:
        deployments = (("deterministic", shipped), ("library", library))
        urls = {name: deploy_local(a, args.port, name=name) for name, a in deployments}
        runs = apps.streams_by_mode(urls, model, PROMPTS, MODES, (args.repeats, args.max_tokens))
    finally:
        stop_local_ray()
    write(args, runs)


if __name__ == "__main__":
    main()
