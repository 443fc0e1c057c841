"""The benchmarks' applications: the shipped YAML's args and variants of them, and local Ray + Serve to run them."""

from __future__ import annotations

import argparse
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from deploy.app import build_app
from deploy.config import AppConfig
from deploy.local.demo import DEFAULT_CONFIG, Streamed, app_block, merged_args, stop_local_ray, stream_chat, wait_ready

REPO = str(Path(__file__).resolve().parents[1])  # the replicas' PYTHONPATH: they import this repository


def served_parser(doc: str | None, max_tokens: int, port: int) -> argparse.ArgumentParser:
    """The arguments of a benchmark of a served YAML: the YAML, tokens per stream, passes, Serve's HTTP port."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="the Serve YAML (default: the shipped one)")
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--repeats", type=int, default=2, help="passes over the prompts, mode order reversed each")
    parser.add_argument("--port", type=int, default=port)
    return parser


def shipped(config: Path | str) -> dict[str, Any]:
    """The first application's `args` of a Serve YAML (an `AppConfig` as plain data)."""
    return app_block(Path(config))[1]


variant = merged_args  # `args` with changes laid over it: nested blocks merge key by key, any other value replaces


def served_name(args: dict[str, Any]) -> str:
    """The model name clients send: the front door's `served_model_name`, else the target model."""
    return AppConfig.model_validate(args).served_model_name


@contextmanager
def local_serve(num_cpus: int, port: int | None = None) -> Iterator[None]:
    """Ray embedded in this process with `num_cpus` logical CPUs, and Serve (HTTP on `port` when given);
    both shut down on leaving."""
    import ray
    from ray import serve

    env = {"env_vars": {"PYTHONPATH": REPO}}
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, runtime_env=env)
    try:
        if port is not None:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield
    finally:
        stop_local_ray()


def deploy_http(apps: dict[str, dict[str, Any]], port: int, timeout_s: float = 900) -> dict[str, str]:
    """Each application of `apps` (name -> args) at route /<name>, loaded before the next one starts;
    their base URLs."""
    from ray import serve

    urls = {}
    for name, args in apps.items():
        app = build_app(AppConfig.model_validate(args))
        deploying = threading.Thread(target=serve.run, args=(app,), kwargs={"name": name, "route_prefix": f"/{name}"})
        deploying.start()
        urls[name] = f"http://127.0.0.1:{port}/{name}"
        wait_ready(urls[name], timeout_s=timeout_s)
        deploying.join()
    return urls


Runs = dict[str, list[list[Streamed]]]  # per mode, per prompt, each pass's stream


def streams_by_mode(
    urls: dict[str, str],
    model: str,
    prompts: dict[str, str],
    modes: dict[str, tuple[str, bool]],
    passes: tuple[int, int],
) -> Runs:
    """Each prompt streamed alone (c = 1) in every mode (`modes[mode]`: the deployment and whether to
    speculate), the modes in turn per prompt, their order reversed each pass, so the machine's drift
    between minutes hits them alike; `passes`: (passes, max_tokens). Each deployment is warmed up first
    (first forwards, kernel choice, connections)."""
    repeats, max_tokens = passes
    out: Runs = {m: [[] for _ in prompts] for m in modes}
    for app in dict.fromkeys(app for app, _ in modes.values()):
        stream_chat(urls[app], model, next(iter(prompts.values())), 8, speculate=True, show=False)
    for rep in range(repeats):
        for i, (name, prompt) in enumerate(prompts.items()):
            for mode in list(modes) if rep % 2 == 0 else list(modes)[::-1]:
                app, speculate = modes[mode]
                out[mode][i].append(stream_chat(urls[app], model, prompt, max_tokens, speculate, show=False))
                print(f"  pass {rep + 1} {name:>9} {mode:>28}: {out[mode][i][-1].rate:.2f} tok/s", flush=True)
    return out
