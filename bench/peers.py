"""specserve beside llama.cpp on the same GGUF files, the same prompts, the same machine, in one run.

The shipped `deploy/local.yaml` (unchanged but for its port) and llama.cpp's `llama-server` (found or built
from PyPI's source package: `bench/llama_cpp.py`) serve the registry's Qwen2.5-Coder 1.5B Q4_K_M target,
whose GGUF file specserve's model folder keeps; llama.cpp's speculative modes draft with the same 0.5B Q4_K_M
file specserve drafts with, or with n-gram lookup. All servers run at once (each idle while another serves)
and every prompt is streamed alone (c = 1) with the official `openai` client, greedy, to each mode in turn,
their order reversed each pass, so the machine's drift between minutes hits them alike:

- decode: tokens/s end to end (first byte to last, as a user sees it) on chat prompts of three kinds;
- prefill: a long prompt's tokens / its first token's time (one new token asked for).

llama.cpp runs on every core (`-t` = cores); specserve as shipped (its target on core 0, its draft and router
beside). Where llama.cpp cannot be had, the run says why and measures specserve alone.

    python -m bench.peers                # ~15 minutes on 2 CPU cores, plus llama.cpp's build the first time
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from bench import apps, figures, llama_cpp, report
from bench.single_stream import PROMPTS as CHAT_PROMPTS
from deploy.local.demo import DEFAULT_CONFIG, Streamed, deploy_local, start_local_ray, stop_local_ray, stream_chat
from modelstore import fetch, get_spec

NAME = "peers"
PROMPTS = {kind: CHAT_PROMPTS[kind] for kind in ("code", "prose", "code-edit")}
# a long prompt for prefill: a module's worth of code to review (~1,100 tokens with the chat template)
PREFILL_PROMPT = "Review this code and name its one bug:\n\n" + "\n".join(
    f"def step_{i}(values, scale={i}):\n    total = 0\n    for v in values:\n        total += v * scale\n"
    f"    return total / max(len(values), 1)\n"
    for i in range(24)
)
LLAMA_MODES = {  # mode -> llama-server's flags beyond the target model's
    "llama.cpp plain": [],
    "llama.cpp draft model": ["--spec-type", "draft-simple", "--spec-draft-n-max", "8", "-md", "{draft}"],
    "llama.cpp n-gram": ["--spec-type", "ngram-mod"],
}
# one slot of 4,096 tokens, no prompt cache: every prompt is computed in full, as specserve computes it
SERVER_FLAGS = ["-c", "4096", "-np", "1", "--no-cache-prompt", "-cram", "0"]
SPECSERVE_MODES = {"specserve speculation": True, "specserve plain": False}  # mode -> speculate


@contextmanager
def llama_servers(binary: Path, target: Path, draft: Path, port: int, modes: list[str]) -> Iterator[dict[str, str]]:
    """One llama-server per mode of `modes` on ports from `port`, on every core; their base URLs."""
    cores = os.cpu_count() or 1
    urls: dict[str, str] = {}
    with ExitStack() as stack:
        for i, mode in enumerate(modes):
            flags = [f.format(draft=draft) for f in LLAMA_MODES[mode]]
            command = [str(binary), "-m", str(target), "-t", str(cores), "--port", str(port + i), *SERVER_FLAGS, *flags]
            log = stack.enter_context(open(Path("/tmp") / f"llama-server-{port + i}.log", "w"))
            server = subprocess.Popen(  # every core, whatever this process's affinity
                command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=lambda: os.sched_setaffinity(0, range(cores))
            )
            stack.callback(_stop, server)
            urls[mode] = f"http://127.0.0.1:{port + i}"
        for mode, url in urls.items():
            _wait(url, mode)
        yield urls


def _stop(server: subprocess.Popen[bytes]) -> None:
    server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()


def _wait(url: str, mode: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{mode}: llama-server at {url} was not ready in {timeout_s:.0f} s")


def measure(urls: dict[str, str], model: str, passes: int, max_tokens: int) -> dict[str, dict[str, list[Streamed]]]:
    """Per mode, per prompt kind (and "prefill"), each pass's stream."""
    modes = list(urls)
    out: dict[str, dict[str, list[Streamed]]] = {m: {k: [] for k in [*PROMPTS, "prefill"]} for m in modes}
    for mode in modes:  # warm-up: first forwards, kernel choice, connections
        stream_chat(urls[mode], model, PROMPTS["code"], 8, speculate=True, show=False)
    for rep in range(passes):
        for kind, prompt in [*PROMPTS.items(), ("prefill", PREFILL_PROMPT)]:
            for mode in modes if rep % 2 == 0 else modes[::-1]:
                speculate = SPECSERVE_MODES.get(mode, True)
                tokens = 1 if kind == "prefill" else max_tokens
                run = stream_chat(urls[mode], model, prompt, tokens, speculate, show=False)
                out[mode][kind].append(run)
                shown = f"{_prefill([run]):.0f} prompt tok/s" if kind == "prefill" else f"{run.rate:.2f} tok/s"
                print(f"  pass {rep + 1} {kind:>9} {mode:>24}: {shown}", flush=True)
    return out


def _rate(runs: list[Streamed]) -> float:
    return sum(r.tokens for r in runs) / sum(r.seconds for r in runs)


def _prefill(runs: list[Streamed]) -> float:
    return sum(r.prompt_tokens for r in runs) / sum(r.first_token_s for r in runs)


def write(args: argparse.Namespace, runs: dict[str, dict[str, list[Streamed]]], why: str | None) -> None:
    modes = list(runs)
    rows = []
    for mode in modes:
        for kind in PROMPTS:
            streams = runs[mode][kind]
            ttft = sum(r.first_token_s for r in streams) / len(streams)
            rows.append([mode, kind, _rate(streams), ttft])
        rows.append([mode, "prefill", _prefill(runs[mode]["prefill"]), runs[mode]["prefill"][0].prompt_tokens])
    summary: dict[str, Any] = {}
    info = report.machine()
    machine = f"{info['cpu']} ({info['isa']}), {info['cores']} cores"
    base = "llama.cpp plain"
    if base in runs:
        for kind in PROMPTS:
            plain = _rate(runs[base][kind])
            summary[f"{kind}: specserve speculation / llama.cpp plain"] = (
                _rate(runs["specserve speculation"][kind]) / plain
            )
            peers = [m for m in modes if m.startswith("llama.cpp") and m != base]
            best = max((_rate(runs[m][kind]) for m in peers), default=0.0)
            if best:
                summary[f"{kind}: specserve speculation / llama.cpp's best speculative"] = (
                    _rate(runs["specserve speculation"][kind]) / best
                )
        every = [r for kind in PROMPTS for r in runs["specserve plain"][kind]]
        summary["specserve plain / llama.cpp plain (all kinds)"] = _rate(every) / _rate(
            [r for kind in PROMPTS for r in runs[base][kind]]
        )
        summary["prefill: specserve / llama.cpp"] = _prefill(runs["specserve speculation"]["prefill"]) / _prefill(
            runs[base]["prefill"]
        )
    else:
        summary["llama.cpp"] = f"not measured: {why}"
    columns = ["mode", "prompt", "tok/s (decode) or prompt tok/s (prefill)", "first token s (decode) or prompt tokens"]
    intro = (
        f"`{Path(args.config).name}` unchanged (the port aside) beside llama.cpp's `llama-server` "
        f"(build {llama_cpp.VERSION.split('.')[0]}, `-t {os.cpu_count()}`), on {machine}: the Qwen2.5-Coder 1.5B "
        "Q4_K_M target both read from the same GGUF file, llama.cpp's draft model the same 0.5B Q4_K_M file "
        "specserve drafts with. Each prompt streamed alone (c = 1), greedy, with the `openai` client, "
        f"{args.max_tokens} new tokens, {args.passes} passes (modes in turn per prompt, their order reversed each "
        "pass). Decode: tokens / seconds from the request to the last token. Prefill: a "
        "long prompt's tokens / its first token's seconds.\n\n" + report.summary_table(summary) + "\n\n"
    )
    data = {"config": vars(args), "summary": summary, "rows": [dict(zip(columns, r, strict=True)) for r in rows]}
    decode = [[m, k, rate] for m, k, rate, _ in rows if k != "prefill"]
    stem = report.write(NAME, data, intro + report.markdown_table(columns, rows) + f"\n\n![rates]({NAME}.png)")
    figures.mode_bars(decode, stem.with_suffix(".png"), "decode tokens/s: specserve and llama.cpp, same GGUF files")
    print(stem.with_suffix(".md").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="the Serve YAML (default: the shipped one)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--passes", type=int, default=2, help="passes over the prompts, mode order reversed each")
    parser.add_argument("--port", type=int, default=8127, help="specserve's; llama-servers take the next ones")
    args = parser.parse_args()
    shipped = apps.shipped(args.config)
    target, draft = (fetch(shipped[key]) / get_spec(shipped[key]).gguf_file for key in ("target_model", "draft_model"))
    model = apps.served_name(shipped)
    why = None
    with ExitStack() as stack:
        try:
            binary = llama_cpp.llama_server()
            urls = stack.enter_context(llama_servers(binary, target, draft, args.port + 1, list(LLAMA_MODES)))
        except llama_cpp.Unavailable as e:
            why, urls = str(e), {}
            print(f"llama.cpp unavailable, specserve alone: {why}", flush=True)
        start_local_ray(shipped)
        stack.callback(stop_local_ray)
        url = deploy_local(shipped, args.port)
        urls = {**{m: url for m in SPECSERVE_MODES}, **urls}
        runs = measure(urls, model, args.passes, args.max_tokens)
    write(args, runs, why)


if __name__ == "__main__":
    main()
