"""Round-ahead drafting at one stream, on the shipped `deploy/local.yaml` unchanged (but for the port).

One run deploys the application twice through Serve's HTTP proxy and streams each code prompt,
one request at a time (c = 1), with the official `openai` client, as a user would:
- round-ahead (the YAML as shipped): with speculation, then with `max_draft_tokens: 0` (plain
  decoding on the same deployment);
- sequential (the YAML with `router.round_ahead: false`): with speculation.
It reports tokens/s, TTFT and acceptance length per prompt, the ratios round-ahead / sequential and
speculation / plain, and the router's round-ahead figures (pre-draft hit rate, the share of draft
time hidden behind verification, draft tokens never verified).

    python -m bench.round_ahead                  # ~6 minutes on 2 CPU cores
    python -m bench.round_ahead --max-tokens 32  # shorter
"""

from __future__ import annotations

import argparse
import copy
import statistics
from pathlib import Path
from typing import Any

from bench import report
from bench.single_stream import PROMPTS as SINGLE_STREAM_PROMPTS
from deploy.demo import DEFAULT_CONFIG, Streamed, app_block, deploy_local, start_local_ray, stream_chat

PROMPTS = {
    "code": SINGLE_STREAM_PROMPTS["code"],
    "code-edit": SINGLE_STREAM_PROMPTS["code-edit"],
    "stack": "Write a Python class for a stack with push, pop and peek.",
}


def deployed_run(args: dict[str, Any], port: int, max_tokens: int, modes: list[str]) -> dict[str, list[Streamed]]:
    """Deploy `args`, stream every prompt in each of `modes` ("spec", "plain"), interleaved per prompt."""
    from ray import serve

    url = deploy_local(args, port)
    model = args.get("front_door", {}).get("served_model_name", args["target_model"])
    try:
        stream_chat(url, model, PROMPTS["code"], 8, speculate=True, show=False)  # warm-up
        out: dict[str, list[Streamed]] = {m: [] for m in modes}
        for prompt in PROMPTS.values():
            for mode in modes:
                out[mode].append(stream_chat(url, model, prompt, max_tokens, speculate=mode == "spec", show=False))
                print(f"  {mode:>5}: {out[mode][-1].rate:.2f} tok/s", flush=True)
        handle = serve.get_app_handle("specserve")
        out["stats"] = [handle.stats.remote().result()]  # type: ignore[list-item]
        return out
    finally:
        serve.delete("specserve")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="the Serve YAML (default: the shipped one)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--name", default="round_ahead")
    args = parser.parse_args()
    _, shipped = app_block(Path(args.config))
    sequential = copy.deepcopy(shipped)
    sequential.setdefault("router_pool", {}).setdefault("router", {})["round_ahead"] = False
    import ray
    from ray import serve

    start_local_ray(shipped)
    try:
        print("round-ahead (the YAML as shipped)", flush=True)
        ahead = deployed_run(shipped, args.port, args.max_tokens, ["spec", "plain"])
        print("sequential (router.round_ahead: false)", flush=True)
        seq = deployed_run(sequential, args.port, args.max_tokens, ["spec"])
    finally:
        serve.shutdown()
        ray.shutdown()
    write(args, ahead, seq)


def _row(name: str, prompt: str, s: Streamed, plain: Streamed, seq: Streamed | None) -> list[Any]:
    return [
        name,
        prompt,
        s.rate,
        s.rate / plain.rate,
        s.rate / seq.rate if seq is not None else float("nan"),
        s.acceptance_length,
        s.first_token_s,
        s.first_token_s / plain.first_token_s,
    ]


def write(args: argparse.Namespace, ahead: dict[str, Any], seq: dict[str, Any]) -> None:
    names = list(PROMPTS)
    rows = []
    for i, prompt in enumerate(names):
        plain = ahead["plain"][i]
        rows.append(_row("round-ahead", prompt, ahead["spec"][i], plain, seq["spec"][i]))
        rows.append(_row("sequential", prompt, seq["spec"][i], plain, None))
        rows.append(_row("plain", prompt, plain, plain, None))

    def total_rate(runs: list[Streamed]) -> float:
        return sum(r.tokens for r in runs) / sum(r.seconds for r in runs)

    ttft = {
        m: statistics.median(r.first_token_s for r in runs)
        for m, runs in (("on", ahead["spec"]), ("off", ahead["plain"]))
    }
    stats = ahead["stats"][0]
    summary = {
        "round_ahead_vs_sequential": total_rate(ahead["spec"]) / total_rate(seq["spec"]),
        "speculation_vs_plain": total_rate(ahead["spec"]) / total_rate(ahead["plain"]),
        "sequential_vs_plain": total_rate(seq["spec"]) / total_rate(ahead["plain"]),
        "ttft_p50_on_s": ttft["on"],
        "ttft_p50_off_s": ttft["off"],
        "ttft_p50_on_vs_off": ttft["on"] / ttft["off"],
        "predraft_hit_rate": stats.get("predraft_hit_rate", 0.0),
        "draft_hidden_share": stats.get("draft_hidden_share", 0.0),
        "draft_tokens_unverified": stats.get("draft_tokens_unverified", 0),
        "predraft_sequences": stats.get("predraft_sequences", 0),
    }
    columns = ["mode", "prompt", "tok/s", "vs plain", "vs sequential", "L", "TTFT s", "TTFT vs plain"]
    intro = (
        f"`{Path(args.config).name}` unchanged (the port aside): Qwen2.5-Coder 1.5B target, 0.5B draft, draft and "
        "target each on their own core (1 CPU, 1 torch thread). Each prompt streamed alone (c = 1), "
        f"{args.max_tokens} new tokens, greedy, with the `openai` client over HTTP. round-ahead: the YAML as "
        "shipped; sequential: `router.round_ahead: false`; plain: `max_draft_tokens: 0` on the round-ahead "
        "deployment. L: acceptance length (tokens per target forward).\n\n"
        "| summary (all prompts' tokens over their seconds) | value |\n|---|---|\n"
        + "\n".join(f"| {k} | {v:.3f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in summary.items())
        + "\n\n"
    )
    data = {"config": vars(args), "summary": summary, "rows": [dict(zip(columns, r, strict=True)) for r in rows]}
    stem = report.write(args.name, data, intro + report.markdown_table(columns, rows))
    plot(rows, stem)
    print(stem.with_suffix(".md").read_text())


def plot(rows: list[list[Any]], stem: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prompts = list(dict.fromkeys(r[1] for r in rows))
    modes = list(dict.fromkeys(r[0] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        rates = {r[1]: r[2] for r in rows if r[0] == mode}
        ax.bar([j + i * width for j in range(len(prompts))], [rates[p] for p in prompts], width, label=mode)
    ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(prompts))], prompts)
    ax.set_ylabel("tokens/s (c = 1)")
    ax.set_title("round-ahead drafting on deploy/local.yaml")
    ax.legend()
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
