"""The GPU benchmark's results as markdown tables and one figure."""

from __future__ import annotations

from typing import Any

from bench import figures
from bench.gpu.bandwidth import headline
from bench.report import markdown_table


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    return markdown_table(columns, [[row.get(c, "-") for c in columns] for row in rows])


def _section(results: dict[str, Any], name: str) -> Any:
    value = results.get(name)
    if isinstance(value, dict) and "error" in value:
        return f"**failed**: {value['error']}"
    return value


def markdown(results: dict[str, Any]) -> str:
    setup = results.get("setup", {})
    parts = [
        f"Models {setup.get('shapes')} built from config with random weights "
        f"(random_models.confident_init), {setup.get('dtype')} on {setup.get('device')}, built in "
        f"{setup.get('build_s', 0):.1f} s. Greedy; our decoder (speculative/), no Ray. T = target-alone "
        "seconds per token (in the oracle table, measured just before each row); V, D = verify and draft "
        "seconds per step; L = tokens per target step; "
        "bound = L*T/(V+D); efficiency = speedup / bound; exact = outputs equal to the target alone's."
    ]
    head = headline(results)
    if head:
        parts.append("## Headline\n\n" + _table([head], list(head)))
    bound = _section(results, "bound")
    if isinstance(bound, dict):
        parts.append("## Bandwidth bound, batch 1 (weights read once per token)\n\n" + _table([bound], list(bound)))
    served = _section(results, "served")
    if isinstance(served, dict):
        rows = [{"row": name, **value} for name, value in served.items() if isinstance(value, dict)]
        cols = ["row", "batch", "tokens", "seconds", "tokens_per_s", "share_of_bound", "speedup", "acceptance"]
        parts.append(
            "## The served application (router, draft pool, target pool on a local Ray; requests through the "
            f"router's handle; drafts agreeing with the target on {served.get('agreement')} of tokens, "
            f"k = {served.get('k')})\n\n"
            + _table(rows, [*cols, "exact", "skipped"])
            + f"\n\nRound ahead vs sequential drafting: {served.get('round_ahead_vs_sequential', '-')}"
        )
    elif served is not None:
        parts.append(f"## The served application\n\n{served}")
    target = _section(results, "target")
    if isinstance(target, dict):
        parts.append("## Target alone, batch 1\n\n" + _table([target], list(target)))
    elif target:
        parts.append(f"## Target alone\n\n{target}")
    oracle = _section(results, "oracle")
    oracle_cols = ["acceptance", "k", "T_ms", "measured_acceptance", "L", "L_expected", "V_ms", "D_ms", "tokens_per_s"]
    oracle_cols += ["speedup", "bound", "efficiency", "exact", "skipped"]
    if oracle is not None:
        text = _table(oracle, oracle_cols) if isinstance(oracle, list) else oracle
        parts.append(f"## Oracle drafts, batch 1\n\n{text}")
    verify = _section(results, "verify")
    if verify is not None:
        cols = ["q", "eager_ms", "eager_vs_q1", "graph_ms", "graph_max_abs_diff", "graph_argmax_equal", "graph_error"]
        text = _table(verify, cols) if isinstance(verify, list) else verify
        parts.append(f"## One target forward over q new tokens\n\n{text}")
    projected = _section(results, "projected")
    if projected is not None:
        cols = ["acceptance", "k", "L", "measured_speedup", "eager_bound", "graph_bound"]
        text = _table(projected, cols) if isinstance(projected, list) else projected
        parts.append(
            "## Bounds from bare forwards: L*F(1)/F(k+1), F = one forward (eager / CUDA graph replay)\n\n"
            "What the decoder would reach with no Python overhead around the forward; graph = with "
            f"launches removed too (graphs: {setup.get('graphs')}).\n\n{text}"
        )
    draft = _section(results, "draft")
    if isinstance(draft, dict):
        cols = ["acceptance", "k", "D_ms", "V_ms", "L", "bound_sequential", "bound_pipelined"]
        forward = _table(draft["forward"], ["q", "eager_ms", "graph_ms", "graph_argmax_equal"])
        parts.append(f"## Draft model: one forward, and bounds with a real draft\n\n{forward}\n\n")
        parts[-1] += _table(draft["bounds"], cols)
    elif draft is not None:
        parts.append(f"## Draft model\n\n{draft}")
    batch = _section(results, "batch")
    if batch is not None:
        cols = ["batch", "acceptance", "k", "alone_tokens_per_s", "spec_tokens_per_s", "speedup", "L"]
        cols += ["alone_step_ms", "spec_V_ms", "exact", "adaptive_speedup", "adaptive_L", "adaptive_exact", "skipped"]
        text = _table(batch, cols) if isinstance(batch, list) else batch
        parts.append(f"## Throughput by batch size\n\n{text}")
    if "tp" in results:
        parts.append(f"## Tensor parallelism\n\n{results['tp']}")
    if "seconds" in results:
        parts.append("Section seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in results["seconds"].items()))
    return "\n\n".join(parts)


def plot(results: dict[str, Any], path: str) -> None:
    oracle = [r for r in results.get("oracle") or [] if isinstance(r, dict) and "speedup" in r]
    verify = results.get("verify") if isinstance(results.get("verify"), list) else []
    fig, (left, right) = figures.figure(2, (11, 4.2))
    labels = [f"a={r['acceptance']}\nk={r['k']}" for r in oracle]
    xs = range(len(oracle))
    left.bar(xs, [r["speedup"] for r in oracle], label="measured")
    left.scatter(xs, [r["bound"] for r in oracle], marker="_", s=300, c="k", label="bound L*T/(V+D)")
    left.set_xticks(list(xs), labels, fontsize=7)
    left.set_ylabel("speedup over target alone")
    left.set_title("Oracle drafts, batch 1")
    left.legend()
    qs = [r["q"] for r in verify or []]
    lines = {"eager": (qs, [r["eager_ms"] for r in verify or []])}
    if verify and "graph_ms" in verify[0]:
        lines["CUDA graph"] = (qs, [r["graph_ms"] for r in verify])
    figures.log2_lines(right, lines, "q new tokens")
    right.set_ylabel("ms per target forward")
    right.set_title("Verify cost")
    right.legend()
    figures.save(fig, path)
