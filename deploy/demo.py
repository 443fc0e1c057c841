"""The demo: the server on an embedded local Ray, with the default models, answering a request.

    python -m deploy.cli serve                 # what `make run` runs
    python -m deploy.cli serve --keep-running  # stay up: http://127.0.0.1:8000/v1, gRPC :9000

Fetches the models of the config (progress per model), starts Ray and Serve in this process,
deploys the application of `deploy/local.yaml`, waits for it to load, then streams one chat
completion through the OpenAI-compatible HTTP API, printing tokens/s and the speculative figures.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from deploy.models import REGISTRY, fetch

DEFAULT_CONFIG = Path(__file__).resolve().parent / "local.yaml"


def _app_block(config_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the Serve config's grpc_options, the first application's args)."""
    data = yaml.safe_load(config_path.read_text())
    return data.get("grpc_options", {}), data["applications"][0]["args"]


def _wait_ready(url: str, timeout_s: float) -> None:
    start = time.monotonic()
    while True:
        elapsed = time.monotonic() - start
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    print(f"\rloading models... ready after {elapsed:.0f} s", file=sys.stderr)
                    return
        except OSError:
            pass
        if elapsed > timeout_s:
            raise TimeoutError(f"the application was not ready after {timeout_s:.0f} s")
        print(f"\rloading models... {elapsed:.0f} s", end="", file=sys.stderr, flush=True)
        time.sleep(1.0)


def _stream(base_url: str, model: str, prompt: str, max_tokens: int) -> None:
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
    start, first, usage = time.perf_counter(), None, None
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    print(f"\n> {prompt}\n", file=sys.stderr)
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                first = first or time.perf_counter()
                print(choice.delta.content, end="", flush=True)
    elapsed = time.perf_counter() - start
    if usage is not None:
        extra = usage.model_extra or {}
        print(
            f"\n\n{usage.completion_tokens} tokens in {elapsed:.1f} s = {usage.completion_tokens / elapsed:.2f} "
            f"tokens/s (first token after {(first or start) - start:.1f} s); acceptance length "
            f"{extra.get('acceptance_length', 0):.2f}, {extra.get('accepted_tokens', 0)}/"
            f"{extra.get('draft_tokens', 0)} draft tokens accepted",
            file=sys.stderr,
        )


def _logical_cpus(args: dict[str, Any]) -> int:
    """Enough logical CPUs for the config's starting replicas (each sets its own torch threads)."""
    from deploy.config import AppConfig

    config = AppConfig.model_validate(args)
    draft, target, router = config.draft_pool, config.target_pool, config.router_pool

    def start(pool: Any) -> int:
        return max(pool.autoscaling.min_replicas, pool.autoscaling.initial_replicas or 1)

    need = router.num_cpus * start(router)
    need += (target.shard_num_cpus * config.tp_size + target.replica_num_cpus) * start(target)
    if config.draft_model is not None:
        need += draft.num_cpus * start(draft)
    return max(os.cpu_count() or 1, math.ceil(need))


def serve_demo(config_path: Path, prompt: str, max_tokens: int, keep_running: bool, port: int = 8000) -> int:
    import ray
    from ray import serve

    from deploy.app import app_builder

    grpc_options, args = _app_block(config_path)
    for key in ("target_model", "draft_model"):
        if args.get(key) in REGISTRY:
            fetch(args[key])
    ray.init(
        address="local",
        num_cpus=_logical_cpus(args),
        include_dashboard=False,
        runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}},
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, grpc_options=grpc_options or None)
        # serve.run returns once every replica has loaded its model: run it aside, show progress here.
        deploying = threading.Thread(
            target=serve.run, args=(app_builder(args),), kwargs={"name": "specserve", "route_prefix": "/"}
        )
        deploying.start()
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, timeout_s=1800)
        deploying.join()
        model = args.get("front_door", {}).get("served_model_name", args["target_model"])
        _stream(url, model, prompt, max_tokens)
        if keep_running:
            print(
                f"\nserving {model}: {url}/v1 (OpenAI), gRPC on :{grpc_options.get('port', 9000)}; Ctrl-C stops",
                file=sys.stderr,
            )
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
