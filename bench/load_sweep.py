"""Load sweep: the running application over HTTP (OpenAI API), speculation on and off, c = 1..32.

One run, same machine, same models. Each mode is its own application on embedded Ray behind
Serve's HTTP proxy (all deployed first, idle while another is measured):
- draft:  the shipped Serve YAML (`--config`, default `deploy/local.yaml`) unchanged: what users run;
- lookup: (only if asked for) the same YAML with prompt lookup in place of the draft model;
- off:    (only if asked for) the same YAML with no drafter: plain continuous batching.
Speculation off is measured on each speculating application itself, as `off@draft` / `off@lookup`:
the same requests with `max_draft_tokens: 0` (plain decoding, same tokens). Each mode is compared
with its own off, on the same processes, so nothing but speculation differs between the two arms
but time: on this 2-core VM the CPU time of identical forwards (same shapes, same code) drifts by
up to 10 % between minute-long windows, more than speculation gains under
load; arms alternate, order reversed each pass, to spread that drift. Each concurrency level runs
every arm in turn, driven by `c` closed-loop clients (each sends its next streamed chat completion
when the last one ends) over a fixed prompt mix (code, prose, list, chat, and code editing whose
answer quotes the prompt).
Requests differ in output length (LENGTHS, mean --max-tokens, ignore_eos so each gets exactly its
own): with equal lengths the requests of a level finish together, and plain decoding then prefills
each new wave as one batch while speculation, which finishes them at different steps, cannot.
Reported per mode and concurrency: output tokens/s while all c clients are busy and past the cold
start of c prompts arriving at once (`steady_window`; the wall-time figure, cold start and tail
included, is kept too), time to first token
and inter-token latency (gap between streamed chunks, per token) p50 / p99, tokens committed per
target step (acceptance length), and the ratio to `off` at the same concurrency. At c = 1 it also
reports the analytic bound L*T/(V+D) of docs/design.md from the same run (T: off's verify step, V and
D: this mode's verify and draft compute inside the workers) and efficiency = speedup / bound.

At c = 1 it also reports each prompt kind's rate on and off (its requests' tokens over their
seconds), so the code prompts can be read apart from the mix.

    python -m bench.load_sweep                                       # deploy/local.yaml
    python -m bench.load_sweep --config deploy/smoke.yaml --concurrency 1 4 --max-tokens 8
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp
from ray import serve

from bench import apps, figures, report
from bench.single_stream import PROMPTS
from deploy.local.demo import DEFAULT_CONFIG
from modelstore import REGISTRY, fetch

NAME = "load_sweep"
DRAFTERS = {"off": "none", "draft": "model", "lookup": "lookup"}
STAT_KEYS = ("verify_s", "draft_s", "step_s", "overhead_share")  # the router's per-step means
OFF = "off@"  # an arm with speculation off on a speculating application: "off@draft"


def arms(modes: list[str]) -> list[str]:
    """What each level measures: every mode, each speculating one followed by its own off."""
    return [a for m in modes for a in ([m] if m == "off" else [m, OFF + m])]


def app_of(arm: str) -> str:
    return arm.removeprefix(OFF)


def baseline(arm: str, measured: list[str]) -> str | None:
    """The arm a mode is compared with: its own application's off, else the plain application."""
    own = OFF + app_of(arm)
    return own if own in measured else ("off" if "off" in measured else None)


def app_args(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """The shipped YAML's application for `draft`; for `lookup` and `off`, the same with that drafter."""
    shipped = apps.shipped(args.config)
    if mode == "draft":
        return shipped
    changes = {"draft_model": None, "drafter": {"kind": DRAFTERS[mode]}}
    return apps.variant(shipped, changes | ({"speculation": {"draft_cost": 0.0}} if mode == "lookup" else {}))


async def one_request(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, extra: dict[str, Any]
) -> dict[str, Any]:
    body = extra | {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    arrivals: list[float] = []
    usage: dict[str, Any] = {}
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(c["delta"].get("content") for c in chunk.get("choices", [])):
                arrivals.append(time.perf_counter())
    seconds = time.perf_counter() - start
    tokens = usage.get("completion_tokens", 0)
    if tokens != max_tokens:
        raise RuntimeError(f"asked for {max_tokens} tokens (ignore_eos), got {tokens}")
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    # Chunks carry several tokens when drafts are accepted: spread each gap over its chunk's tokens.
    per_token = (tokens - 1) / len(gaps) if gaps else 1.0
    return {
        "tokens": tokens,
        "seconds": seconds,
        "arrivals": arrivals,
        "chunks": len(arrivals),
        "ttft": arrivals[0] - start if arrivals else float("nan"),
        "itl": [g / per_token for g in gaps],
        "steps": usage.get("steps", tokens),
        "acceptance_length": usage.get("acceptance_length", 1.0),
    }


KINDS = {text: kind for kind, text in PROMPTS.items()}
CODE = ("code", "code-edit")  # the code prompts of the mix

# Output lengths of the mix, as fractions of --max-tokens (mean 1): real requests differ in length, and
# equal ones would finish together and make plain decoding prefill each wave in one batch.
LENGTHS = (0.75, 1.0, 1.25, 0.5, 1.5)


def workload(requests: int, max_tokens: int) -> list[tuple[str, int]]:
    """(prompt, output tokens) per request: every prompt kind meets every length as requests grow."""
    texts = list(PROMPTS.values())
    return [
        (texts[i % len(texts)], max(round(max_tokens * LENGTHS[(i + i // len(texts)) % len(LENGTHS)]), 1))
        for i in range(requests)
    ]


async def level(
    url: str, c: int, requests: int, max_tokens: int, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
    for item in workload(requests, max_tokens):
        queue.put_nowait(item)
    results: list[dict[str, Any]] = []
    exits: list[float] = []

    async def client(session: aiohttp.ClientSession) -> None:
        first = True
        while not queue.empty():
            prompt, n = queue.get_nowait()
            done = await one_request(session, url, prompt, n, extra or {})
            results.append(done | {"first": first, "kind": KINDS[prompt]})
            first = False
        exits.append(time.perf_counter())

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        await asyncio.gather(*[client(session) for _ in range(c)])
        wall = time.perf_counter() - start
    begin, until = steady_window(results, exits, start)
    for r in results:  # a request's tokens spread evenly over its streamed chunks
        per_chunk, arrivals = r["tokens"] / max(r["chunks"], 1), r.pop("arrivals")
        r["steady_tokens"] = per_chunk * sum(begin < t <= until for t in arrivals)
        r["busy_tokens"] = per_chunk * sum(t <= until for t in arrivals)  # the burst in: from the level's start
    return {"concurrency": c, "results": results, "window": until - begin, "busy": until - start, "wall": wall}


def steady_window(results: list[dict[str, Any]], exits: list[float], start: float) -> tuple[float, float]:
    """The span of a level in which its c clients are all busy and past their cold start: from the last
    first token of the clients' first requests (until then the level is the burst of c prompts arriving
    at once, prefilled before any token flows) to the first client running out of requests (after it,
    fewer than c are busy). Counting the burst would weigh it by how soon the level ends: an arm that
    finishes some requests sooner (speculation on quoting prompts) ends its window sooner, with the
    same burst in it, and would read slower for being faster. Falls back to the start if no window is
    left (a client with one request)."""
    until = min(exits)
    firsts = [r["arrivals"][0] for r in results if r.get("first") and r["arrivals"]]
    begin = max(firsts, default=start)
    return (begin, until) if begin < until else (start, until)


def merge(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from one or more passes of a level on a mode (their requests and seconds pooled)."""
    results = [r for p in passes for r in p["results"]]
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results]
    itl = [g for r in results for g in r["itl"]]
    window, wall = sum(p["window"] for p in passes), sum(p["wall"] for p in passes)
    return {
        "concurrency": passes[0]["concurrency"],
        "passes": len(passes),
        "requests": len(results),
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": sum(r["steady_tokens"] for r in results) / window,
        "pass_tokens_per_s": [sum(r["steady_tokens"] for r in p["results"]) / p["window"] for p in passes],
        "wall_tokens_per_s": tokens / wall,
        "busy_tokens_per_s": sum(r["busy_tokens"] for r in results) / sum(p["busy"] for p in passes),
        "steady_seconds": window,
        "ttft_p50": _pct(ttft, 50),
        "ttft_p99": _pct(ttft, 99),
        "itl_p50": _pct(itl, 50),
        "itl_p99": _pct(itl, 99),
        "acceptance_length": tokens / max(sum(r["tokens"] / r["acceptance_length"] for r in results), 1e-9),
        # per prompt kind (and the code prompts together): their requests' tokens over their seconds
        "by_kind": {
            kind: sum(r["tokens"] for r in mine) / sum(r["seconds"] for r in mine)
            for kind, mine in _by_kind(results).items()
        },
    }


def _by_kind(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups = {kind: [r for r in results if r["kind"] == kind] for kind in PROMPTS}
    groups["code prompts"] = [r for r in results if r["kind"] in CODE]
    return {kind: mine for kind, mine in groups.items() if mine}


def _pct(xs: list[float], q: int) -> float:
    if not xs:
        return float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def measure(args: argparse.Namespace, urls: dict[str, str]) -> list[dict[str, Any]]:
    """Each concurrency level on every arm in turn, so a disturbance of the machine hits them alike."""
    handles = {mode: serve.get_app_handle(mode) for mode in args.modes}
    model = {"model": apps.served_name(app_args(args, "draft"))}
    extra = {arm: model | ({"max_draft_tokens": 0} if arm.startswith(OFF) else {}) for arm in arms(args.modes)}
    for mode in args.modes:  # warm-up: first forwards, kernel choice, connections, cost measurements
        asyncio.run(level(urls[mode], 2, 6, 16, model))
    rows = []
    for c in args.concurrency:
        per_client = max(args.requests_per_client, -(-args.min_requests // c))  # every client sends as many
        passes: dict[str, list[dict[str, Any]]] = {arm: [] for arm in extra}
        stats: dict[str, list[dict[str, float]]] = {arm: [] for arm in extra}
        for rep in range(args.repeats):  # arms in turn, the order reversed each pass (ABC CBA)
            for arm in list(extra) if rep % 2 == 0 else list(extra)[::-1]:
                handle, url = handles[app_of(arm)], urls[app_of(arm)]
                handle.stats.remote(reset=True).result()
                passes[arm].append(asyncio.run(level(url, c, per_client * c, args.max_tokens, extra[arm])))
                stats[arm].append(handle.stats.remote(reset=True).result())
        for arm in extra:
            row = merge(passes[arm])
            mean = {k: statistics.fmean(st.get(k, 0.0) for st in stats[arm]) for k in STAT_KEYS}
            row |= {"mode": arm, **mean}
            rows.append(row)
            print(
                f"{arm:>10} c={c:<3} {row['tokens_per_s']:7.2f} tok/s  L={row['acceptance_length']:.2f}  "
                f"ttft p50 {row['ttft_p50']:.2f} s  itl p50 {1e3 * row['itl_p50']:.0f} ms",
                flush=True,
            )
    return rows


def summarize(rows: list[dict[str, Any]]) -> None:
    """Ratios to each mode's off at each concurrency, and at c = 1 the bound L*T/(V+D) and efficiency."""
    measured = list(dict.fromkeys(r["mode"] for r in rows))
    by = {(r["mode"], r["concurrency"]): r for r in rows}
    for r in rows:
        base = by.get((baseline(r["mode"], measured) or "", r["concurrency"]))
        r["vs_off"] = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        for key in ("wall", "busy"):  # the same ratio over the whole level, and with its cold start in
            mine_s, theirs_s = r.get(f"{key}_tokens_per_s"), base.get(f"{key}_tokens_per_s") if base else None
            r[f"{key}_vs_off"] = mine_s / theirs_s if mine_s and theirs_s else float("nan")
        mine, theirs = r.get("pass_tokens_per_s", []), base.get("pass_tokens_per_s", []) if base else []
        r["vs_off_by_pass"] = [a / b for a, b in zip(mine, theirs, strict=True)] if theirs else []
        r["vs_off_ci"] = ratio_interval(r["vs_off_by_pass"])
        theirs_by_kind = base.get("by_kind", {}) if base else {}
        r["by_kind_vs_off"] = {k: v / theirs_by_kind[k] for k, v in r.get("by_kind", {}).items() if k in theirs_by_kind}
        r["bound"] = r["efficiency"] = float("nan")
        if base and r["concurrency"] == 1 and r["verify_s"] + r["draft_s"] > 0:
            r["bound"] = r["acceptance_length"] * base["verify_s"] / (r["verify_s"] + r["draft_s"])
            r["efficiency"] = r["vs_off"] / r["bound"]


# Two-sided 95 % quantiles of Student's t by degrees of freedom (passes - 1); past 10, 10's (wider).
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}


def ratio_interval(ratios: list[float]) -> list[float]:
    """95 % interval of the ratio on/off from per-pass ratios (t interval on their logs), [] under 2 passes.

    Passes pair each arm with its off adjacent in time, so a pass's ratio carries the machine's drift
    between the two windows; the interval says how far the pooled ratio can be moved by that noise.
    """
    if len(ratios) < 2:
        return []
    logs = [math.log(x) for x in ratios]
    half = _T95[min(len(logs) - 1, 10)] * statistics.stdev(logs) / math.sqrt(len(logs))
    mid = statistics.fmean(logs)
    return [math.exp(mid - half), math.exp(mid + half)]


def plot(rows: list[dict[str, Any]], stem: Path) -> None:
    fig, axes = figures.figure(3, (15, 4))
    panels = (
        ("tokens_per_s", 1.0, "throughput (output tokens/s)"),
        ("ttft_p50", 1.0, "time to first token p50 (s)"),
        ("itl_p50", 1e3, "inter-token latency p50 (ms)"),
    )
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    by_mode = {m: sorted((r for r in rows if r["mode"] == m), key=lambda r: r["concurrency"]) for m in modes}
    for ax, (key, scale, title) in zip(axes, panels, strict=True):
        lines = {m: ([r["concurrency"] for r in mine], [scale * r[key] for r in mine]) for m, mine in by_mode.items()}
        figures.log2_lines(ax, lines, "concurrent clients")
        ax.set_title(title)
        ax.legend()
    figures.save(fig, stem.with_suffix(".png"))


def write(args: argparse.Namespace, rows: list[dict[str, Any]], measured_on: dict[str, Any] | None = None) -> None:
    summarize(rows)
    columns = ["mode", "c", "tok/s", "vs off", "wall tok/s", "wall vs off", "burst-in vs off", "L"]
    columns += ["TTFT p50 s", "TTFT p99 s", "ITL p50 ms"]
    columns += ["ITL p99 ms"]
    columns += ["verify ms", "draft ms", "bound", "efficiency", "vs off by pass", "vs off 95 % CI"]
    table = [
        [r["mode"], r["concurrency"], r["tokens_per_s"], r["vs_off"], r.get("wall_tokens_per_s", float("nan"))]
        + [r.get("wall_vs_off", float("nan")), r.get("busy_vs_off", float("nan"))]
        + [r["acceptance_length"], r["ttft_p50"]]
        + [r["ttft_p99"], 1e3 * r["itl_p50"], 1e3 * r["itl_p99"], 1e3 * r["verify_s"], 1e3 * r["draft_s"]]
        + [r["bound"], r["efficiency"], " ".join(f"{x:.2f}" for x in r.get("vs_off_by_pass", []))]
        + ["-".join(f"{x:.2f}" for x in r.get("vs_off_ci", [])) or "-"]
        for r in sorted(rows, key=lambda r: (r["concurrency"], arms(args.modes).index(r["mode"])))
    ]
    first = [r for r in rows if r["concurrency"] == min(args.concurrency) and r.get("by_kind_vs_off")]
    kinds = list(dict.fromkeys(k for r in first for k in r["by_kind_vs_off"]))
    per_kind = report.markdown_table(
        ["mode", *(f"{k} vs off" for k in kinds)],
        [[r["mode"], *(r["by_kind_vs_off"].get(k) for k in kinds)] for r in first],
    )
    intro = (
        f"`{Path(args.config).name}` unchanged (the route prefix aside) for draft; "
        f"output tokens per request {', '.join(f'{f:g}' for f in LENGTHS)} x {args.max_tokens} (ignore_eos), "
        "greedy, streamed over HTTP; draft: quotes drafted by prompt lookup (`lookup_quotes`); "
        f"{args.requests_per_client} requests per client (at least {args.min_requests}) per level and pass, "
        f"{args.repeats} passes (arms in turn, order reversed each pass, requests pooled); "
        "prompt mix: " + ", ".join(PROMPTS) + ".\n\n"
        "tok/s: output tokens per second while all c clients are busy and past their cold start (from the "
        "last first token of the clients' first requests until the first client runs out of requests: "
        "`steady_window`); wall tok/s: over the whole level, cold start and tail included; burst-in vs off: "
        "the tok/s ratio with the window starting at the level's start, which "
        "weighs the cold-start burst by how soon the window ends. "
        "off@mode: that mode's application with speculation off per request (`max_draft_tokens: 0`). "
        "vs off: tok/s over the same application's off at the same concurrency. L: output tokens per target "
        "step. ITL: gap between streamed chunks divided by the tokens they carry. bound (c = 1): "
        "L*T/(V+D) with T = off's verify compute per step, V, D = this mode's verify and draft compute "
        "per step (inside the workers), the sequential bound (round-ahead drafting hides D behind V); "
        "efficiency = vs off / bound. vs off by pass: each pass's tok/s "
        "over its off's in the same pass (arms adjacent in time): their spread is the machine's noise; "
        "vs off 95 % CI: the t interval of those ratios (on their logs), the range that noise leaves the "
        "ratio in.\n\n"
    )
    data = {"config": vars(args), "rows": rows}
    figure = f"\n\n![sweep]({NAME}.png)"
    kinds_md = (
        f"\n\nAt c = {min(args.concurrency)}, by prompt kind (tokens over seconds of its requests):\n\n{per_kind}"
    )
    markdown = intro + report.markdown_table(columns, table) + kinds_md + figure
    stem = report.write(NAME, data, markdown, measured_on=measured_on)
    plot(rows, stem)
    print(stem.with_suffix(".md").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="the Serve YAML (default: the shipped one)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--modes", nargs="+", default=["draft"], choices=list(DRAFTERS), help="applications to deploy")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(  # a client's first request is its cold start, outside the steady window
        "--requests-per-client", type=int, default=3, help="requests each client sends per level and pass"
    )
    parser.add_argument("--min-requests", type=int, default=5, help="at least one of each prompt kind")
    parser.add_argument("--repeats", type=int, default=2, help="passes per level, mode order reversed each")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--render", metavar="JSON", help="only rewrite md/png from an earlier run's JSON")
    args = parser.parse_args()
    if args.render:
        write(*report.earlier_run(args.render))
        return
    shipped = app_args(args, "draft")
    for model in (shipped["target_model"], shipped.get("draft_model")):
        if model is not None and model in REGISTRY:
            fetch(model)
    # Logical CPUs: a draft replica, a target shard and a router per mode; every mode loaded before any is measured.
    with apps.local_serve(num_cpus=3 * len(args.modes), port=args.port):
        urls = apps.deploy_http({mode: app_args(args, mode) for mode in args.modes}, args.port)
        rows = measure(args, urls)
    write(args, rows)


if __name__ == "__main__":
    main()
