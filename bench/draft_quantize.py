"""The draft model's weight formats (`draft_quantize`) side by side: what a draft step costs and how often it agrees.

One process, the Qwen2.5-Coder pair of `deploy/local.yaml`, one torch thread (what a draft replica gets there).
For each format the draft is loaded and run as a replica does (`actors.loading.load_lm`, `cpu_linear: onednn`,
the runner's lean stack, `speculative/engine/lean_stack.py`):
- none: the draft in `dtype: auto` (bfloat16 where the CPU computes it natively, else float32);
- int8: torch's dynamic int8 Linear on a float32 model;
- int4: 4-bit weight groups for forwards of a few tokens, bfloat16 beyond
  (`speculative/engine/cpu/int4_linear.py`), once
  with each kernel: `vnni` (int8 activations, AVX-512 VNNI, one thread; what a replica picks where it runs) and
  `aten` (torch's weight-only kernel, bfloat16 activations),
and timed on a forward of q = 1, 2, 5 chained tokens over a 96-token cache (a draft level, a small tree, a
catch-up after a verdict) and on a 64-token prefill (a prompt's catch-up). Agreement: over the target's own
greedy continuation of each prompt (64 tokens), the share of positions where the draft's top-1 token is the
target's (teacher-forced, one token per forward as a draft step runs), which bounds a chain's acceptance.

    python -m bench.draft_quantize               # ~3 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, DynamicCache, PreTrainedModel

from actors.config import ModelConfig, Quantize
from actors.loading import load_lm
from bench import figures, report
from bench.cpu_linear import seconds
from bench.single_stream import PROMPTS
from modelstore import resolve
from speculative.engine.cpu import int4_vnni
from speculative.engine.cpu.int4_linear import Kernel, int4_quantized
from speculative.engine.cpu.onednn_linear import packed
from speculative.engine.loading import chat_ids, resolve_dtype, resolve_quantize
from speculative.engine.runner import ModelRunner, chain_parents

NAME = "draft_quantize"
FORMATS: tuple[tuple[Quantize, Kernel | None], ...] = (
    ("none", None),
    ("int8", None),
    ("int4", "vnni"),
    ("int4", "aten"),
)
AGREEMENT_PROMPTS = ("code", "code-edit", "list", "prose")


def step_ms(runner: ModelRunner, q: int, reps: int) -> float:
    """A forward of q chained tokens at the end of the cache (then dropped: the cache stays as it was)."""

    def step() -> None:
        runner.forward([list(range(5, 5 + q))], [chain_parents(q)], [[q - 1]])
        runner.commit([[]])

    return 1e3 * seconds(step, reps)


def prefill_ms(model: PreTrainedModel, tokens: int, reps: int) -> float:
    runner = ModelRunner(model, lean=True)  # as a draft replica runs it (`ModelDrafterConfig.build`)

    def prefill() -> None:
        runner.add_rows(["p"])
        runner.extend([list(range(1000, 1000 + tokens))])
        runner.remove_rows(["p"])

    return 1e3 * seconds(prefill, reps)


@torch.inference_mode()
def top1(model: PreTrainedModel, ids: list[int], start: int) -> list[int]:
    """The model's most likely next token after each of ids[start - 1:-1]: the prompt prefilled, then one
    token per forward (a draft step's shape, so 4-bit layers compute with their 4-bit weights)."""
    cache = DynamicCache()
    model(torch.tensor([ids[: start - 1]]), past_key_values=cache, use_cache=True)
    guesses = []
    for token in ids[start - 1 : -1]:
        logits = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1]  # [V]
        guesses.append(int(logits.float().argmax()))
    return guesses


def load_draft(path: str, fmt: Quantize, kernel: Kernel | None, threads: int) -> PreTrainedModel:
    """The draft as a replica loads it; an int4 one with the given kernel."""
    if kernel is None:
        return load_lm(ModelConfig(path=path, quantize=fmt, cpu_linear="onednn", torch_threads=threads))
    bf16 = load_lm(ModelConfig(path=path, dtype="bfloat16", cpu_linear="torch", torch_threads=threads))
    return packed(int4_quantized(bf16, kernel), "onednn")  # quantized, then packed, as `load_lm` orders them


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    target_path, draft_path = resolve(args.target), resolve(args.draft)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    target = load_lm(ModelConfig(path=target_path, cpu_linear="onednn", torch_threads=args.threads))
    paths = {}  # prompt -> (prompt ids + the target's greedy continuation, prompt length)
    for name in AGREEMENT_PROMPTS:
        prompt = chat_ids(tokenizer, PROMPTS[name])
        # transformers' stubs type `generate` as a tensor attribute
        out = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=args.new_tokens)  # type: ignore[operator]
        paths[name] = (out[0].tolist(), len(prompt))
    del target
    rows = []
    for fmt, kernel in FORMATS:
        if kernel == "vnni" and (args.threads != 1 or int4_vnni.library() is None):
            continue  # the kernel runs with one torch thread on AVX-512 VNNI CPUs
        model = load_draft(draft_path, fmt, kernel, args.threads)
        label = f"{fmt} ({kernel})" if kernel else fmt
        row: dict[str, Any] = {"format": label, "resolved": resolve_quantize(fmt), "dtype": str(model.dtype)}
        runner = ModelRunner(model, lean=True)  # as a draft replica runs it (`ModelDrafterConfig.build`)
        runner.add_rows(["s"])
        runner.extend([list(range(1000, 1000 + args.cache))])
        with torch.inference_mode():
            for q in args.steps:
                row[f"q{q}_ms"] = step_ms(runner, q, args.reps)
            row["prefill_ms"] = prefill_ms(model, args.prefill, max(args.reps // 4, 3))
        for name, (ids, start) in paths.items():
            guessed = top1(model, ids, start)
            row[f"agree_{name}"] = sum(g == t for g, t in zip(guessed, ids[start:], strict=True)) / len(guessed)
        print(row, flush=True)
        rows.append(row)
        del runner, model
    return rows


def plot(rows: list[dict[str, Any]], steps: list[int], stem: Path) -> None:
    fig, (ax,) = figures.figure()
    figures.grouped_bars(ax, [f"q={q}" for q in steps], {r["format"]: [r[f"q{q}_ms"] for q in steps] for r in rows})
    ax.set_ylabel("ms per draft forward (1 thread)")
    ax.legend()
    figures.save(fig, stem.with_suffix(".png"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen-1.5b")
    parser.add_argument("--draft", default="qwen-0.5b")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a draft replica of local.yaml: 1)")
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 2, 5], help="tokens per timed forward")
    parser.add_argument("--cache", type=int, default=96, help="tokens in the cache the steps attend to")
    parser.add_argument("--prefill", type=int, default=64, help="tokens of the timed prefill")
    parser.add_argument("--new-tokens", type=int, default=64, help="the target's continuation, per prompt")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    rows = measure(args)
    columns = [
        "draft_quantize",
        "weights",
        *(f"q={q} ms" for q in args.steps),
        f"prefill {args.prefill} ms",
        *(f"top-1 agreement {p}" for p in AGREEMENT_PROMPTS),
    ]
    table = [
        [
            r["format"],
            f"{r['resolved']} ({r['dtype'].removeprefix('torch.')})",
            *(r[f"q{q}_ms"] for q in args.steps),
            r["prefill_ms"],
            *(r[f"agree_{p}"] for p in AGREEMENT_PROMPTS),
        ]
        for r in rows
    ]
    intro = (
        f"Qwen2.5-Coder {args.draft} as the draft of {args.target}, {args.threads} torch thread(s), median of "
        f"{args.reps} forwards over a {args.cache}-token cache; target dtype here: {resolve_dtype('auto')}. "
        f"Agreement: the draft's top-1 along the target's greedy {args.new_tokens} tokens.\n\n"
    )
    stem = report.write(NAME, {"config": vars(args), "rows": rows}, intro + report.markdown_table(columns, table))
    plot(rows, args.steps, stem)
    print(stem.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
