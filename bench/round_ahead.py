"""Round-ahead drafting at one stream, on the shipped `deploy/local.yaml` unchanged (but for the port).

One run deploys the application twice side by side behind Serve's HTTP proxy and streams each
code prompt, one request at a time (c = 1), with the official `openai` client, as a user would,
the modes in turn per prompt (order reversed each pass):
- round-ahead (the YAML as shipped): with speculation;
- sequential (the YAML with `router.round_ahead: false`): with speculation;
- plain: `max_draft_tokens: 0` on the round-ahead deployment (plain decoding, same processes).
It reports tokens/s, TTFT and acceptance length per prompt, the ratios round-ahead / sequential and
speculation / plain, TTFT with and without the draft pool from many short adjacent on/off request
pairs (`first_tokens`), and the router's round-ahead figures (pre-draft hit rate, the share of draft
time hidden behind verification, draft tokens never verified).

    python -m bench.round_ahead                  # ~10 minutes on 2 CPU cores
    python -m bench.round_ahead --max-tokens 32  # shorter
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from bench import apps, figures, report
from bench.single_stream import PROMPTS as SINGLE_STREAM_PROMPTS
from deploy.local.demo import Streamed, deploy_local, start_local_ray, stop_local_ray, stream_chat

NAME = "round_ahead"
PROMPTS = {
    "code": SINGLE_STREAM_PROMPTS["code"],
    "code-edit": SINGLE_STREAM_PROMPTS["code-edit"],
    "stack": "Write a Python class for a stack with push, pop and peek.",
}


MODES = {"round-ahead": ("ahead", True), "sequential": ("sequential", True), "plain": ("ahead", False)}


def measure(urls: dict[str, str], model: str, max_tokens: int, repeats: int) -> apps.Runs:
    """Per mode, per prompt, each pass's stream (`apps.streams_by_mode`)."""
    return apps.streams_by_mode(urls, model, PROMPTS, MODES, (repeats, max_tokens))


def first_tokens(url: str, model: str, rounds: int, max_tokens: int) -> dict[str, list[float]]:
    """Time to first token with speculation on and off (`max_draft_tokens: 0`) on one deployment: short
    requests (only their first token is timed), each prompt on then off, the order flipped every
    request pair, `rounds` times over the prompts: many adjacent pairs, so minutes of drift cancel."""
    out: dict[str, list[float]] = {"on": [], "off": []}
    for rep in range(rounds):
        for i, prompt in enumerate(PROMPTS.values()):
            for speculate in (True, False) if (rep + i) % 2 == 0 else (False, True):
                r = stream_chat(url, model, prompt, max_tokens, speculate, show=False)
                out["on" if speculate else "off"].append(r.first_token_s)
    return out


def main() -> None:
    parser = apps.served_parser(__doc__, max_tokens=64, port=8123)
    parser.add_argument(
        "--ttft-rounds", type=int, default=12, help="rounds of short on/off pairs over the prompts, timing first tokens"
    )
    parser.add_argument("--ttft-max-tokens", type=int, default=8, help="tokens each first-token request asks for")
    args = parser.parse_args()
    shipped = apps.shipped(args.config)
    sequential = apps.variant(shipped, {"router_pool": {"router": {"round_ahead": False}}})
    model = apps.served_name(shipped)
    from ray import serve

    start_local_ray(shipped, apps=2)
    try:
        urls = {
            name: deploy_local(a, args.port, name=name) for name, a in (("ahead", shipped), ("sequential", sequential))
        }
        runs = measure(urls, model, args.max_tokens, args.repeats)
        stats = serve.get_app_handle("ahead").stats.remote().result()
        firsts = first_tokens(urls["ahead"], model, args.ttft_rounds, args.ttft_max_tokens)
    finally:
        stop_local_ray()
    write(args, runs, stats, firsts)


def _rate(runs: list[Streamed]) -> float:
    return sum(r.tokens for r in runs) / sum(r.seconds for r in runs)


def _decode_rate(runs: list[Streamed]) -> float:
    """Tokens after the first over the seconds after it: the stream's pace once the prompt is in."""
    return sum(r.tokens - 1 for r in runs) / sum(r.seconds - r.first_token_s for r in runs)


Runs = apps.Runs


def write(args: argparse.Namespace, runs: Runs, stats: dict[str, Any], firsts: dict[str, list[float]]) -> None:
    rows = []
    for i, prompt in enumerate(PROMPTS):
        plain, seq = _rate(runs["plain"][i]), _rate(runs["sequential"][i])
        for mode in MODES:
            mine = runs[mode][i]
            rate = _rate(mine)
            first = statistics.median(r.first_token_s for r in mine)
            plain_first = statistics.median(r.first_token_s for r in runs["plain"][i])
            length = statistics.fmean(r.acceptance_length for r in mine) if mode != "plain" else 1.0
            rows.append([mode, prompt, rate, rate / plain, rate / seq, length, first, first / plain_first])

    def total(mode: str) -> float:
        return _rate([r for per_prompt in runs[mode] for r in per_prompt])

    def after_first(mode: str) -> float:
        return _decode_rate([r for per_prompt in runs[mode] for r in per_prompt])

    def ttft(mode: str) -> float:
        return statistics.median(r.first_token_s for per_prompt in runs[mode] for r in per_prompt)

    summary = {
        "round_ahead_vs_sequential": total("round-ahead") / total("sequential"),
        "speculation_vs_plain": total("round-ahead") / total("plain"),
        "sequential_vs_plain": total("sequential") / total("plain"),
        # the same after each stream's first token (prefill, the same work in every mode, left out)
        "round_ahead_vs_sequential_after_first_token": after_first("round-ahead") / after_first("sequential"),
        # the first-token pairs (many adjacent samples); the long streams' own first tokens in the table
        "ttft_p50_on_s": statistics.median(firsts["on"]),
        "ttft_p50_off_s": statistics.median(firsts["off"]),
        "ttft_p50_on_vs_off": statistics.median(firsts["on"]) / statistics.median(firsts["off"]),
        "ttft_pairs": len(firsts["on"]),
        "ttft_p50_streams_on_vs_off": ttft("round-ahead") / ttft("plain"),
        "predraft_hit_rate": stats.get("predraft_hit_rate", 0.0),
        "predraft_cut_hits": stats.get("predraft_cut_hits", 0),
        "draft_hidden_share": stats.get("draft_hidden_share", 0.0),
        "draft_tokens_unverified": stats.get("draft_tokens_unverified", 0),
        "predraft_sequences": stats.get("predraft_sequences", 0),
    }
    columns = ["mode", "prompt", "tok/s", "vs plain", "vs sequential", "L", "TTFT p50 s", "TTFT vs plain"]
    intro = (
        f"`{Path(args.config).name}` unchanged (the port and route aside): Qwen2.5-Coder 1.5B target, 0.5B draft, "
        "draft and target each on their own core (1 CPU, 1 torch thread). Each prompt streamed alone (c = 1), "
        f"{args.max_tokens} new tokens, greedy, with the `openai` client over HTTP, {args.repeats} passes (modes in "
        "turn per prompt, their order reversed each pass). round-ahead: the YAML as shipped; sequential: the "
        "same YAML with `router.round_ahead: false`, deployed beside it; plain: `max_draft_tokens: 0` on the "
        "round-ahead deployment. L: acceptance length (tokens per target forward). Round-ahead figures: the "
        "router's stats of the round-ahead deployment over the whole run. ttft_p50_*: time to first token from "
        f"{args.ttft_rounds} rounds over the prompts of {args.ttft_max_tokens}-token requests on the round-ahead "
        "deployment, speculation on then off (order flipped each pair); ttft_p50_streams_on_vs_off: the same "
        "ratio from the long streams above (fewer samples).\n\n" + report.summary_table(summary)
    )
    data = {"config": vars(args), "summary": summary, "rows": [dict(zip(columns, r, strict=True)) for r in rows]}
    stem = report.write(NAME, data, intro + report.markdown_table(columns, rows) + f"\n\n![rates]({NAME}.png)")
    plot(rows, stem)
    print(stem.with_suffix(".md").read_text())


def plot(rows: list[list[Any]], stem: Path) -> None:
    figures.mode_bars(rows, stem.with_suffix(".png"), "round-ahead drafting on deploy/local.yaml")


if __name__ == "__main__":
    main()
