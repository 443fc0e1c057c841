"""The GPU benchmark's measurements (`python -m bench.gpu`), each through the real speculative core (no Ray).

T: seconds per token of the target alone (our decoder, no drafter); V, D: seconds per step spent
verifying and drafting; L: tokens committed per target step. Bound = L*T/(V+D) (docs/design.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import PreTrainedModel

from bench.gpu.forward_cost import forward_costs, sync
from bench.gpu.oracle import OracleDrafter
from speculative.decoder import Planning, SpeculativeDecoder
from speculative.drafters.base import Drafter, DraftRequest, Proposal
from speculative.drafters.config import drafter_config
from speculative.engine.runner import ModelRunner
from speculative.planning.costs import StepCosts
from speculative.planning.depth import DepthConfig, expected_tokens
from speculative.planning.sequence import Sequence
from speculative.rules.sampling import SamplingParams
from speculative.target import TargetVerifier


@dataclass
class Bench:
    """What every section shares."""

    target: PreTrainedModel
    draft: PreTrainedModel | None
    prompt_len: int
    new_tokens: int
    prompts: int  # single-stream prompts
    reps: int  # timing repetitions of one forward
    graphs: str  # forward_cost.CAPTURES key ("cuda", "dry": no graph, same code) or "off"

    @property
    def device(self) -> torch.device:
        return next(self.target.parameters()).device

    @property
    def vocab(self) -> int:
        return int(self.target.config.vocab_size)

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=self.new_tokens, ignore_eos=True)

    def make_prompts(self, n: int, seed: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(seed)
        return [torch.randint(0, self.vocab, (self.prompt_len,), generator=gen).tolist() for _ in range(n)]


def run_decoder(
    bench: Bench, drafter: Drafter | None, k: int, prompts: list[list[int]], load_adaptive: bool = False
) -> dict[str, Any]:
    """All prompts as one batch; wall time includes the device's work (synchronized). `load_adaptive`:
    depths by acceptance and measured step costs (load_control.py) instead of always k."""
    adaptive = DepthConfig(adaptive=load_adaptive, max_depth=k, draft_cost=0.0)
    costs = StepCosts(adaptive) if load_adaptive else None
    traced = TracedDrafter(drafter, costs) if drafter is not None else None
    decoder = SpeculativeDecoder(TargetVerifier(ModelRunner(bench.target)), traced, adaptive, planning=Planning(costs))
    sync(bench.device)
    start = time.perf_counter()
    seqs: list[Sequence] = decoder.generate(prompts, bench.params)
    sync(bench.device)
    seconds = time.perf_counter() - start
    steps = decoder.times.steps
    return {
        "outputs": [p + s.output for p, s in zip(prompts, seqs, strict=True)],
        "tokens": sum(len(s.output) for s in seqs),
        "seconds": seconds,
        "steps": steps,
        "seq_steps": sum(s.stats.steps for s in seqs),  # target forwards each sequence took part in
        "accepted": sum(s.stats.accepted for s in seqs),
        "verify_s": decoder.times.verify / max(steps, 1),
        "draft_s": decoder.times.draft / max(steps, 1),
        "rounds": traced.rounds if traced else [],  # per round: sequences, draft tokens, calibration after it
        "verify_curve": {round(p.x): p.seconds for p in costs.verify.points.values()} if costs else None,
    }


class TracedDrafter:
    """A drafter recording each round it drafts: sequences, draft tokens, and the load control's
    calibration after the round before (what the load control chose)."""

    def __init__(self, inner: Drafter, costs: StepCosts | None) -> None:
        self.inner, self.costs = inner, costs
        self.rounds: list[tuple[int, int, float]] = []

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        proposals = self.inner.propose(requests)
        calibration = self.costs.calibration if self.costs else 1.0
        self.rounds.append((len(proposals), sum(p.tree.size for p in proposals), round(calibration, 3)))
        return proposals

    def release(self, seq_ids: list[str]) -> None:
        self.inner.release(seq_ids)

    def cached_sequences(self) -> int:
        return self.inner.cached_sequences()


def single_stream(bench: Bench, drafter: Drafter | None, k: int, prompts: list[list[int]]) -> dict[str, Any]:
    """Each prompt alone (batch 1), summed."""
    runs = [run_decoder(bench, drafter, k, [p]) for p in prompts]
    total = {key: sum(r[key] for r in runs) for key in ("tokens", "seconds", "steps", "seq_steps", "accepted")}
    total["outputs"] = [r["outputs"][0] for r in runs]
    for key in ("verify_s", "draft_s"):
        total[key] = sum(r[key] * r["steps"] for r in runs) / max(total["steps"], 1)
    return total


def target_alone(bench: Bench, prompts: list[list[int]]) -> tuple[dict[str, Any], list[list[int]]]:
    """T and the references (the target's greedy sequences) the oracle follows."""
    single_stream(bench, None, 0, [p[: bench.prompt_len // 2] for p in prompts[:1]])  # warm-up
    run = single_stream(bench, None, 0, prompts)
    t = run["seconds"] / run["tokens"]
    row = {"tokens": run["tokens"], "seconds": run["seconds"], "T_ms": t * 1e3, "tokens_per_s": 1 / t}
    return row, run["outputs"]


def oracle_row(bench: Bench, run: dict[str, Any], oracle: OracleDrafter, k: int, t: float) -> dict[str, Any]:
    length = run["tokens"] / run["seq_steps"]
    verify, draft = run["verify_s"], run["draft_s"]
    bound = length * t / (verify + draft)
    speedup = t * run["tokens"] / run["seconds"]
    return {
        "acceptance": oracle.acceptance,
        "k": k,
        "measured_acceptance": oracle.stats.acceptance,
        "L": length,
        "L_expected": expected_tokens(oracle.acceptance, k),
        "V_ms": verify * 1e3,
        "D_ms": draft * 1e3,
        "tokens_per_s": run["tokens"] / run["seconds"],
        "speedup": speedup,
        "bound": bound,
        "efficiency": speedup / bound,
        "off_reference": oracle.stats.off_reference,
    }


def oracle_grid(
    bench: Bench,
    prompts: list[list[int]],
    refs: list[list[int]],
    grid: list[tuple[float, int]],
    deadline: float,
) -> list[dict[str, Any]]:
    """Batch-1 speculation with the oracle at each (acceptance, k); exact = output equals refs.

    Each row's T is the target alone (our decoder, no drafter) measured just before it: a launch-bound
    GPU host drifts by tens of percent over a run, so a T taken once at the start can put a speedup
    past L (V below T)."""
    single_stream(bench, OracleDrafter(refs, 0.8, bench.vocab), max(k for _, k in grid), prompts[:1])  # warm-up
    rows = []
    for acceptance, k in grid:
        if time.monotonic() > deadline:
            rows.append({"acceptance": acceptance, "k": k, "skipped": "time budget"})
            continue
        plain = single_stream(bench, None, 0, prompts)
        t = plain["seconds"] / plain["tokens"]
        oracle = OracleDrafter(refs, acceptance, bench.vocab, seed=1)
        run = single_stream(bench, oracle, k, prompts)
        row = {"T_ms": t * 1e3, **oracle_row(bench, run, oracle, k, t)}
        row["exact"] = _exact(run["outputs"], refs)
        rows.append(row)
        print(f"  oracle a={acceptance} k={k}: {_brief(row)}", flush=True)
    return rows


def verify_cost(bench: Bench, qs: list[int], deadline: float) -> list[dict[str, Any]]:
    context = bench.prompt_len + bench.new_tokens // 2
    return forward_costs(bench.target, context, qs, bench.reps, bench.graphs, deadline)


def draft_cost(
    bench: Bench, prompts: list[list[int]], oracle_rows: list[dict[str, Any]], t: float, deadline: float
) -> dict[str, Any]:
    """The draft model's forward cost, its real drafting cost D(k) in our decoder, and the bound it implies."""
    assert bench.draft is not None
    context = bench.prompt_len + bench.new_tokens // 2
    forward = forward_costs(bench.draft, context, [1], bench.reps, bench.graphs, deadline)
    measured = [r for r in oracle_rows if "V_ms" in r]
    rows = []
    for k in sorted({r["k"] for r in measured}):
        if time.monotonic() > deadline:
            break
        drafter = drafter_config(kind="model").build(bench.draft, bench.vocab)
        run = run_decoder(bench, drafter, k, prompts[:1])  # random draft: acceptance ~0, but D per step is real
        d = run["draft_s"]
        verify = [r["V_ms"] / 1e3 for r in measured if r["k"] == k]
        v = sum(verify) / len(verify)
        for acceptance in sorted({r["acceptance"] for r in measured if r["k"] == k}):
            length = expected_tokens(acceptance, k)
            rows.append(
                {
                    "acceptance": acceptance,
                    "k": k,
                    "D_ms": d * 1e3,
                    "V_ms": v * 1e3,
                    "L": length,
                    "bound_sequential": length * t / (v + d),
                    "bound_pipelined": length * t / max(v, d),
                }
            )
    return {"forward": forward, "bounds": rows}


def batched(bench: Bench, sizes: list[int], acceptance: float, k: int, deadline: float) -> list[dict[str, Any]]:
    """Throughput of the target alone and of oracle speculation with B sequences in one batch, at a
    fixed depth k and with depths chosen by load (adaptive). Prompt lengths are mixed (a quarter to
    all of prompt_len), so the joining prefill is packed beside the decodes (speculative/engine/packing.py)."""
    rows = []
    for size in sizes:
        if time.monotonic() > deadline:
            rows.append({"batch": size, "skipped": "time budget"})
            continue
        prompts = bench.make_prompts(size, seed=100 + size)
        prompts = [p[: max(len(p) * (1 + i % 4) // 4, 1)] for i, p in enumerate(prompts)]  # mixed lengths
        alone = run_decoder(bench, None, 0, prompts)
        spec = run_decoder(bench, OracleDrafter(alone["outputs"], acceptance, bench.vocab, seed=1), k, prompts)
        adapt = run_decoder(bench, OracleDrafter(alone["outputs"], acceptance, bench.vocab, seed=1), k, prompts, True)
        row = {
            "batch": size,
            "acceptance": acceptance,
            "k": k,
            "alone_tokens_per_s": alone["tokens"] / alone["seconds"],
            "spec_tokens_per_s": spec["tokens"] / spec["seconds"],
            "L": spec["tokens"] / spec["seq_steps"],
            "alone_step_ms": alone["seconds"] / alone["steps"] * 1e3,
            "spec_V_ms": spec["verify_s"] * 1e3,
            "exact": _exact(spec["outputs"], alone["outputs"]),
            "adaptive_tokens_per_s": adapt["tokens"] / adapt["seconds"],
            "adaptive_L": adapt["tokens"] / adapt["seq_steps"],
            "adaptive_exact": _exact(adapt["outputs"], alone["outputs"]),
            "adaptive_rounds": adapt["rounds"],
            "adaptive_verify_curve": adapt["verify_curve"],
        }
        row["speedup"] = row["spec_tokens_per_s"] / row["alone_tokens_per_s"]
        row["adaptive_speedup"] = row["adaptive_tokens_per_s"] / row["alone_tokens_per_s"]
        rows.append(row)
        print(f"  batch {size}: {_brief(row)}", flush=True)
        print(f"    adaptive rounds (n, drafted, calibration): {adapt['rounds']}", flush=True)
        print(f"    adaptive verify curve (tokens: s): {adapt['verify_curve']}", flush=True)
    return rows


def _exact(outputs: list[list[int]], references: list[list[int]]) -> str:
    """How many outputs equal their reference, as 'k/n'."""
    return f"{sum(o == r for o, r in zip(outputs, references, strict=True))}/{len(outputs)}"


def projected(oracle_rows: list[dict[str, Any]], verify_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Speedup bounds from bare forward times: L*F(1)/F(k+1), eager and graph-replayed (no runner overhead)."""
    forward = {r["q"]: r for r in verify_rows}
    rows = []
    for row in oracle_rows:
        if "L" not in row or 1 not in forward or int(row["k"]) + 1 not in forward:
            continue
        k = int(row["k"])
        out = {"acceptance": row["acceptance"], "k": k, "L": row["L"], "measured_speedup": row["speedup"]}
        for kind in ("eager", "graph"):
            if f"{kind}_ms" in forward[1] and f"{kind}_ms" in forward[k + 1]:
                out[f"{kind}_bound"] = row["L"] * forward[1][f"{kind}_ms"] / forward[k + 1][f"{kind}_ms"]
        rows.append(out)
    return rows


def context_share(model: PreTrainedModel, refs: list[list[int]], prompt_len: int) -> float:
    """Fraction of generated tokens that differ from the current token's fixed successor (see random_models)."""
    head: torch.Tensor = cast(Any, model.get_output_embeddings()).weight  # [V, H]
    embed: torch.Tensor = cast(Any, model.get_input_embeddings()).weight  # [V, H]
    pairs = [(seq[i], seq[i + 1]) for seq in refs for i in range(prompt_len - 1, len(seq) - 1)]
    if not pairs:
        return 0.0
    current = torch.tensor([a for a, _ in pairs], device=embed.device)
    successor = (embed[current].float() @ head.float().T).argmax(-1).cpu()  # [n]
    return float((successor != torch.tensor([b for _, b in pairs])).float().mean())


def _brief(row: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
