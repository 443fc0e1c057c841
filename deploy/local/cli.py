"""`specserve` command line.

specserve generate --prompt "..."   # in-process speculative decoding, streamed to the terminal
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


def _serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from deploy.local.demo import DEFAULT_CONFIG, serve_demo

    config = Path(args.config) if args.config else DEFAULT_CONFIG
    return serve_demo(config, args.prompt, args.max_tokens, args.keep_running, args.port, args.metrics_port)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="speculative decoding in this process, streamed")
    gen.add_argument("--target", default="qwen-1.5b", help="registry name, local HF folder or hub id")
    gen.add_argument("--draft", default="qwen-0.5b", help="registry name, local HF folder or hub id")
    gen.add_argument("--drafter", choices=["model", "lookup", "none"], default="model")
    gen.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--max-depth", type=int, default=4)
    gen.add_argument("--tree-width", type=int, default=1)
    gen.add_argument("--tree-nodes", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=_generate)
    srv = sub.add_parser("serve", help="the server on an embedded local Ray, answering one streamed request")
    srv.add_argument("--config", default=None, help="a Serve YAML (default: deploy/local.yaml)")
    srv.add_argument("--prompt", default="Write a Python function that checks whether a number is prime.")
    srv.add_argument("--max-tokens", type=int, default=96)
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--metrics-port", type=int, default=8080, help="Ray's Prometheus endpoint (/metrics)")
    srv.add_argument("--keep-running", action="store_true", help="keep serving after the demo request")
    srv.set_defaults(func=_serve)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
