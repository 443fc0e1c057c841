"""`python -m modelstore fetch | path | list`: the model store's command line."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from modelstore.registry import DEFAULT_FETCH, REGISTRY, get_spec
from modelstore.store import CACHE_ENV, fetch, is_complete, model_dir


def _peak_rss_mb() -> float | None:
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m modelstore", description="specserve model store")
    parser.add_argument("--cache-dir", default=None, help=f"default: ${CACHE_ENV} or ~/.cache/specserve/models")
    commands = parser.add_subparsers(dest="command", required=True)
    fetch_cmd = commands.add_parser("fetch", help="download and convert models")
    fetch_cmd.add_argument("names", nargs="*", default=list(DEFAULT_FETCH), metavar="NAME")
    fetch_cmd.add_argument("--cache-dir", default=argparse.SUPPRESS)
    path_cmd = commands.add_parser("path", help="print a model's folder (fetching it if needed)")
    path_cmd.add_argument("name", metavar="NAME")
    path_cmd.add_argument("--cache-dir", default=argparse.SUPPRESS)
    list_cmd = commands.add_parser("list", help="show the registry and what is fetched")
    list_cmd.add_argument("--cache-dir", default=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    try:
        if args.command == "fetch":
            for name in args.names:
                get_spec(name)  # fail fast on a typo, before any download
            for name in args.names:
                if is_complete(model_dir(name, args.cache_dir)):
                    print(f"[{name}] already fetched: {model_dir(name, args.cache_dir)}", flush=True)
                    continue
                started = time.perf_counter()
                folder = fetch(name, args.cache_dir, log=lambda message: print(message, flush=True))
                peak = _peak_rss_mb()
                peak_text = f", peak RSS so far {peak / 1024:.1f} GiB" if peak is not None else ""
                print(f"[{name}] ready: {folder} ({time.perf_counter() - started:.1f}s{peak_text})", flush=True)
        elif args.command == "path":
            print(fetch(args.name, args.cache_dir))
        else:
            for spec in REGISTRY.values():
                folder = model_dir(spec.name, args.cache_dir)
                state = "fetched" if is_complete(folder) else "not fetched"
                print(f"{spec.name:14} {spec.role:7} {spec.title:40} {state:12} {folder}")
    except (ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
