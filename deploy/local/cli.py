"""`specserve` command line.

specserve serve                                  # deploy/local.yaml: the server, one request, its report
specserve serve qwen-1.5b --draft qwen-0.5b      # the same settings for other models (vLLM's `vllm serve MODEL`)
specserve serve smollm2-135m --drafter lookup --keep-running
specserve generate --prompt "..."                # in-process speculative decoding, streamed to the terminal
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from speculative.drafters.config import drafter_config
from speculative.planning.depth import DepthConfig
from speculative.rules.sampling import SamplingParams


def _generate(args: argparse.Namespace) -> int:
    from deploy.local.decoder import LocalModels

    t0 = time.perf_counter()
    print(f"loading target {args.target} and draft {args.draft} ({args.dtype})...", file=sys.stderr)
    shape = {"tree_width": args.tree_width, "tree_nodes": args.tree_nodes}
    drafter = drafter_config(kind=args.drafter, **(shape if args.drafter == "model" else {}))
    models = LocalModels.load(args.target, args.draft if drafter.needs_draft_model else None, args.dtype)
    print(f"loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    decoder = models.decoder(drafter, DepthConfig(max_depth=args.max_depth))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    prompt = models.chat_prompt(args.prompt)
    decoder.add(prompt, params)
    tok = models.tokenizer
    start, shown, out = time.perf_counter(), "", []
    while decoder.has_work:
        for step in decoder.step():
            out += step.new_tokens
            text = str(tok.decode(out, skip_special_tokens=True))
            print(text[len(shown) :], end="", flush=True)
            shown = text
    elapsed = time.perf_counter() - start
    (seq,) = decoder.finished
    print(
        f"\n\n{len(seq.output)} tokens in {elapsed:.1f} s = {len(seq.output) / elapsed:.2f} tokens/s; "
        f"{seq.stats.steps} target steps, acceptance length {seq.stats.acceptance_length:.2f} "
        f"({seq.stats.accepted}/{seq.stats.drafted} draft tokens accepted); finish: {seq.finish_reason}",
        file=sys.stderr,
    )
    return 0


def model_overrides(args: argparse.Namespace) -> dict[str, object]:
    """What `specserve serve MODEL [--draft D] [--drafter K] [--tp N]` changes in the config's application args."""
    out: dict[str, object] = {}
    if args.model is not None:
        out |= {"target_model": args.model, "front_door": {"served_model_name": args.model}}
    if args.drafter is not None:
        out["drafter"] = {"kind": args.drafter}
        if args.drafter != "model":
            out["draft_model"] = None
    if args.draft is not None:
        out["draft_model"] = args.draft
    if args.tp is not None:
        out["tp_size"] = args.tp
    return out


def _serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from deploy.local.demo import DEFAULT_CONFIG, serve_demo

    config = Path(args.config) if args.config else DEFAULT_CONFIG
    overrides = model_overrides(args)
    return serve_demo(config, args.prompt, args.max_tokens, args.keep_running, args.port, args.metrics_port, overrides)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="speculative decoding in this process, streamed")
    gen.add_argument("--target", default="qwen-1.5b", help="registry name, local HF folder or hub id")
    gen.add_argument("--draft", default="qwen-0.5b", help="registry name, local HF folder or hub id")
    gen.add_argument("--drafter", choices=["model", "lookup", "none"], default="model", help="what drafts")
    gen.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="the models' dtype")
    gen.add_argument("--prompt", required=True, help="the user message (the target's chat template applied)")
    gen.add_argument("--max-tokens", type=int, default=128, help="new tokens at most")
    gen.add_argument("--max-depth", type=int, default=4, help="draft tokens along any path at most")
    gen.add_argument("--tree-width", type=int, default=1, help="draft branches per node (1: a chain)")
    gen.add_argument("--tree-nodes", type=int, default=16, help="draft tree nodes at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--seed", type=int, default=0, help="the sampling seed")
    gen.set_defaults(func=_generate)
    srv = sub.add_parser(
        "serve",
        help="the server on an embedded local Ray: one streamed request and its report, then serving on request",
        description="Serve a config's application on this machine (Ray embedded), stream one request with and "
        "without speculation and report both; --keep-running serves on. A MODEL (and --draft, --drafter, --tp) "
        "replaces the config's models and keeps its other settings.",
    )
    srv.add_argument(
        "model",
        nargs="?",
        default=None,
        help="the target: a registry name, local HF folder or hub id (default: the config's)",
    )
    srv.add_argument(
        "--draft", default=None, help="the draft model (default: the config's; none with --drafter lookup)"
    )
    srv.add_argument(
        "--drafter", choices=["model", "lookup", "none"], default=None, help="what drafts (default: the config's)"
    )
    srv.add_argument("--tp", type=int, default=None, help="tensor-parallel shards per target replica")
    srv.add_argument("--config", default=None, help="a Serve YAML (default: deploy/local.yaml)")
    srv.add_argument(
        "--prompt",
        default="Write a Python function that checks whether a number is prime.",
        help="the request streamed at start",
    )
    srv.add_argument("--max-tokens", type=int, default=96, help="its new tokens")
    srv.add_argument("--port", type=int, default=8000, help="the OpenAI HTTP port (127.0.0.1)")
    srv.add_argument("--metrics-port", type=int, default=8080, help="Ray's Prometheus endpoint (/metrics)")
    srv.add_argument("--keep-running", action="store_true", help="keep serving after the request, until Ctrl-C")
    srv.set_defaults(func=_serve)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
