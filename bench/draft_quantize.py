"""The draft model's weight formats (`draft_quantize`) side by side with torchao's: what a draft step costs and how
often it agrees.

One process, the Qwen2.5-Coder pair of `deploy/local.yaml`, one torch thread (what a draft replica gets there).
For each format the draft is loaded and run as a replica does (`actors.loading.load_lm`, `cpu_linear: onednn`,
the runner's lean stack, `speculative/engine/lean_stack.py`):
- none: the draft in `dtype: auto` (bfloat16 where the CPU computes it natively, else float32);
- int8: int8 weights, a float32 model (`speculative/engine/cpu/int8_linear.py`), once with each kernel: `avx2`
  (ours, `kernels/int8_avx2.c`, up to 8 rows; what a replica picks where it runs) and `torch` (torch's own
  int8 kernels alone);
- int4: 4-bit weight groups for forwards of a few tokens, bfloat16 beyond
  (`speculative/engine/cpu/int4_linear.py`), once
  with each kernel: `vnni` (int8 activations, AVX-512 VNNI, one thread; what a replica picks where it runs) and
  `aten` (torch's weight-only kernel, bfloat16 activations);
- torchao's CPU configs of the same schemes (`torchao.quantization.quantize_` on every Linear, the LM head too;
  no oneDNN packing): int8 activations x int8 weights, int8 weights alone, int4 weights alone (groups of 32,
  torch's `_weight_int4pack_mm_for_cpu`) and int8 activations x int4 weights (`da8w4`, groups of 32: the VNNI
  kernel's scheme);
and timed on a forward of q = 1, 2, 5 chained tokens over a 96-token cache (a draft level, a small tree, a
catch-up after a verdict) and on a 64-token prefill (a prompt's catch-up). Agreement: over the target's own
greedy continuation of each prompt (64 tokens), the share of positions where the draft's top-1 token is the
target's (teacher-forced, one token per forward as a draft step runs), which bounds a chain's acceptance.
A format that cannot run on this machine is listed under the table with the reason.

    python -m bench.draft_quantize               # ~20 minutes on 2 AVX2 cores (torchao's int8 x int8 row ~6)
    python -m bench.draft_quantize --reps 3 --new-tokens 4 --prefill 16 --results /tmp/smoke   # a smoke: ~7 min
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, DynamicCache, PreTrainedModel

from actors.config import Dtype, ModelConfig, Quantize
from actors.loading import load_lm
from bench import figures, report
from bench.cpu_linear import seconds
from bench.single_stream import PROMPTS
from modelstore import resolve
from speculative.engine.cpu import compiled, int4_vnni, int8_avx2
from speculative.engine.cpu.int4_linear import Kernel, int4_quantized
from speculative.engine.cpu.int8_linear import Int8Linear
from speculative.engine.cpu.onednn_linear import native_bf16, packed
from speculative.engine.loading import chat_ids, resolve_dtype
from speculative.engine.runner import ModelRunner, chain_parents

NAME = "draft_quantize"
CPU_FLAGS = ("avx2", "avx512_vnni", "avx512_bf16", "amx_tile")  # the ones that decide which kernels run fast


@dataclass(frozen=True)
class Format:
    """One row: `load` (draft path, torch threads -> the model as it runs), `unavailable` (torch threads -> why
    it cannot run on this machine, None where it can), `weights` (the weights' format, for the table)."""

    label: str
    weights: str
    load: Callable[[str, int], PreTrainedModel]
    unavailable: Callable[[int], str | None]


def replica(quantize: Quantize) -> Callable[[str, int], PreTrainedModel]:
    """The draft as a replica loads it with `draft_quantize: quantize`."""
    return lambda path, threads: load_lm(
        ModelConfig(path=path, quantize=quantize, cpu_linear="onednn", torch_threads=threads)
    )


def int4_with(kernel: Kernel) -> Callable[[str, int], PreTrainedModel]:
    def load(path: str, threads: int) -> PreTrainedModel:
        bf16 = load_lm(ModelConfig(path=path, dtype="bfloat16", cpu_linear="torch", torch_threads=threads))
        return packed(int4_quantized(bf16, kernel), "onednn")  # quantized, then packed, as `load_lm` orders them

    return load


def int8_torch(path: str, threads: int) -> PreTrainedModel:
    """`draft_quantize: int8` on torch's kernels alone: what a CPU without AVX2 (or without the built kernel) runs."""
    model = replica("int8")(path, threads)
    for module in model.modules():
        if isinstance(module, Int8Linear):
            module.torch_kernels_only()
    return model


def avx2_unavailable(threads: int) -> str | None:
    if threads != 1:
        return "the kernel runs with one torch thread (--threads 1)"
    if not compiled.cpu_supports(compiled.AVX2_CPU):
        return "needs AVX2 and FMA, which this CPU lacks"
    return None if int8_avx2.library() is not None else "not built (setup.py's build_ext: a C compiler)"


def vnni_unavailable(threads: int) -> str | None:
    if threads != 1:
        return "the kernel runs with one torch thread (--threads 1)"
    if not compiled.cpu_supports():
        return "needs AVX-512 VNNI and BF16, which this CPU lacks"
    return None if int4_vnni.library() is not None else "not built (setup.py's build_ext: a C compiler)"


def always(threads: int) -> str | None:
    return None


@functools.cache
def torchao() -> tuple[Callable[..., Any], dict[str, Any]] | None:
    """torchao's `quantize_` and its CPU configs by name (torchao 0.18's, as its docs give them); None where
    torchao is not installed (an optional import: its rows are then listed as not run)."""
    try:
        from torchao.prototype.quantization.int4.inference_workflow import (
            Int8DynamicActivationInt4WeightConfig,
            PrototypeInt4WeightOnlyConfig,
        )
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_
    except ImportError:
        return None
    return quantize_, {
        "da8w8": Int8DynamicActivationInt8WeightConfig(set_inductor_config=False),
        "w8": Int8WeightOnlyConfig(set_inductor_config=False),
        "w4": PrototypeInt4WeightOnlyConfig(group_size=32, set_inductor_config=False),
        "da8w4": Int8DynamicActivationInt4WeightConfig(group_size=32, set_inductor_config=False),
    }


def torchao_with(name: str, dtype: Dtype) -> Callable[[str, int], PreTrainedModel]:
    def load(path: str, threads: int) -> PreTrainedModel:
        api = torchao()
        assert api is not None  # `torchao_unavailable` said so first
        quantize, configs = api
        model = load_lm(ModelConfig(path=path, dtype=dtype, cpu_linear="torch", torch_threads=threads))
        quantize(model, configs[name])
        return model

    return load


def torchao_unavailable(threads: int) -> str | None:
    return None if torchao() is not None else "torchao is not installed (pip install torchao==0.18.0)"


def da8w4_unavailable(threads: int) -> str | None:
    if (why := torchao_unavailable(threads)) is not None:
        return why
    if "CPU" not in torch._C._dispatch_dump("torchao::da8w4_linear_cpu"):  # registered by the import, kernel or not
        return (
            "torchao's wheel has no CPU kernel for torchao::da8w4_linear_cpu (built from source with "
            "USE_CPU_KERNELS=1 it has one, whose fast path needs AVX-512 VNNI)"
        )
    return None


# the dtype of `draft_quantize: none` on this machine (`dtype: auto`), and of torchao's int8 rows
NATIVE: Dtype = "bfloat16" if native_bf16("cpu") else "float32"
FORMATS = (
    Format("none", f"none ({NATIVE})", replica("none"), always),
    Format("int8 (avx2)", "int8 (float32)", replica("int8"), avx2_unavailable),
    Format("int8 (torch)", "int8 (float32)", int8_torch, always),
    Format("int4 (vnni)", "int4 (bfloat16)", int4_with("vnni"), vnni_unavailable),
    Format("int4 (aten)", "int4 (bfloat16)", int4_with("aten"), always),
    Format("torchao int8 x int8", f"int8 ({NATIVE})", torchao_with("da8w8", NATIVE), torchao_unavailable),
    Format("torchao int8 weights", f"int8 ({NATIVE})", torchao_with("w8", NATIVE), torchao_unavailable),
    Format("torchao int4 weights", "int4 (bfloat16)", torchao_with("w4", "bfloat16"), torchao_unavailable),
    Format("torchao int8 x int4 (da8w4)", "int4 (bfloat16)", torchao_with("da8w4", "bfloat16"), da8w4_unavailable),
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


def cpu_flags() -> str:
    """Which of CPU_FLAGS this CPU has, as /proc/cpuinfo names them."""
    return ", ".join(f"{flag} {'yes' if compiled.cpu_supports(frozenset({flag})) else 'no'}" for flag in CPU_FLAGS)


def measure(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The rows of every format that runs here, and why each other one does not."""
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
    rows, skipped = [], {}
    for fmt in FORMATS:
        if (why := fmt.unavailable(args.threads)) is not None:
            skipped[fmt.label] = why
            continue
        model = fmt.load(draft_path, args.threads)
        row: dict[str, Any] = {"format": fmt.label, "weights": fmt.weights}
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
    return rows, skipped


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
    parser.add_argument(
        "--results", type=Path, default=report.RESULTS, help="folder of the result set (a smoke run: elsewhere)"
    )
    args = parser.parse_args()
    rows, skipped = measure(args)
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
            r["weights"],
            *(r[f"q{q}_ms"] for q in args.steps),
            r["prefill_ms"],
            *(r[f"agree_{p}"] for p in AGREEMENT_PROMPTS),
        ]
        for r in rows
    ]
    intro = (
        f"Qwen2.5-Coder {args.draft} as the draft of {args.target}, {args.threads} torch thread(s), median of "
        f"{args.reps} forwards over a {args.cache}-token cache; target dtype here: {resolve_dtype('auto')}; CPU "
        f"flags: {cpu_flags()}. Agreement: the draft's top-1 along the target's greedy {args.new_tokens} tokens.\n\n"
    )
    not_run = "".join(f"\n- {label}: {why}" for label, why in skipped.items())
    markdown = intro + report.markdown_table(columns, table) + (f"\n\nNot run here:{not_run}" if not_run else "")
    data = {"config": {**vars(args), "results": str(args.results)}, "rows": rows, "not_run": skipped}
    stem = report.write(NAME, data, markdown, folder=args.results)
    plot(rows, args.steps, stem)
    print(stem.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
