"""The demo: the server on an embedded local Ray, with the default models, answering a request.

    python -m deploy.local.cli serve                 # what `make run` runs
    python -m deploy.local.cli serve --keep-running  # stay up: http://127.0.0.1:8000/v1, gRPC :9000,
                                               # Prometheus http://127.0.0.1:8080/metrics

Fetches the models of the config (progress per model), starts Ray and Serve in this process,
deploys the application of `deploy/local.yaml`, waits for it to load, then streams the same chat
completion through the OpenAI-compatible HTTP API twice: with speculation, and with
`max_draft_tokens: 0` (plain decoding, the same tokens), and prints both rates side by side with
the acceptance length. Ray's and Serve's own log lines go to Ray's session folder, not here; Ray's
metrics agent serves the application's metrics for Prometheus on `--metrics-port` (docs/metrics.md).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from modelstore import REGISTRY, fetch

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "local.yaml"  # deploy/local.yaml
METRICS_PORT = 8080  # Prometheus endpoint of Ray's metrics agent: the port the cluster and k8s/ use


def merged_args(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` merged in, nested dicts key by key."""
    out = dict(base)
    for key, value in overrides.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merged_args(out[key], value) if nested else value
    return out


def with_overrides(args: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """An application's `args` with `specserve serve`'s `overrides` merged in; a `drafter` block replaces the
    config's (its fields belong to its kind: a lookup drafter takes no tree width)."""
    if "drafter" in overrides:
        args = {k: v for k, v in args.items() if k != "drafter"}
    return merged_args(args, overrides)


def app_block(config_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the Serve config's grpc_options, the first application's args)."""
    data = yaml.safe_load(config_path.read_text())
    return data.get("grpc_options", {}), data["applications"][0]["args"]


def wait_ready(url: str, timeout_s: float, failed: Callable[[], BaseException | None] = lambda: None) -> None:
    """Until `url`/health answers 200; raises as soon as `failed()` (the deployment's error) is not None."""
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
        if (error := failed()) is not None:
            raise RuntimeError(f"the deployment failed after {elapsed:.0f} s (logs: the folder above)") from error
        print(f"\rloading models... {elapsed:.0f} s", end="", file=sys.stderr, flush=True)
        time.sleep(1.0)


@dataclass(frozen=True)
class Streamed:
    """One streamed completion, as its client saw it."""

    text: str
    tokens: int
    seconds: float
    first_token_s: float
    acceptance_length: float
    drafted: int
    accepted: int
    prompt_tokens: int = 0
    predicted: tuple[int, int] | None = None  # with a prediction: (accepted, rejected) prediction tokens

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def stream_chat(
    base_url: str, model: str, prompt: str, max_tokens: int, speculate: bool, show: bool, prediction: str | None = None
) -> Streamed:
    """One greedy chat streamed to its end with the `openai` client; `prediction`: sent as Predicted Outputs."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
    start, first, usage, text = time.perf_counter(), None, None, []
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=({} if speculate else {"max_draft_tokens": 0})
        | ({} if prediction is None else {"prediction": {"type": "content", "content": prediction}}),
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                first = first or time.perf_counter()
                text.append(choice.delta.content)
                if show:
                    print(choice.delta.content, end="", flush=True)
    elapsed = time.perf_counter() - start
    extra = (usage.model_extra or {}) if usage is not None else {}
    return Streamed(
        "".join(text),
        usage.completion_tokens if usage is not None else 0,
        elapsed,
        (first or start) - start,
        float(extra.get("acceptance_length", 0.0)),
        int(extra.get("draft_tokens", 0)),
        int(extra.get("accepted_tokens", 0)),
        usage.prompt_tokens if usage is not None else 0,
        _predicted(usage),
    )


def _predicted(usage: Any) -> tuple[int, int] | None:
    details = getattr(usage, "completion_tokens_details", None)
    if details is None or details.accepted_prediction_tokens is None:
        return None
    return int(details.accepted_prediction_tokens), int(details.rejected_prediction_tokens or 0)


def _report(spec: Streamed, plain: Streamed) -> str:
    """Both runs side by side, and what speculation bought."""
    rows = [("", "speculative", "plain (max_draft_tokens 0)")]
    rows.append(("tokens", str(spec.tokens), str(plain.tokens)))
    rows.append(("seconds", f"{spec.seconds:.1f}", f"{plain.seconds:.1f}"))
    rows.append(("tokens/s", f"{spec.rate:.2f}", f"{plain.rate:.2f}"))
    rows.append(("first token (s)", f"{spec.first_token_s:.2f}", f"{plain.first_token_s:.2f}"))
    rows.append(("acceptance length", f"{spec.acceptance_length:.2f}", "1.00"))
    rows.append(("draft tokens accepted", f"{spec.accepted}/{spec.drafted}", "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    speedup = spec.rate / plain.rate if plain.rate > 0 else 0.0
    return "\n".join([*lines, f"speculation: {speedup:.2f}x the plain rate; {_agreement(spec.text, plain.text)}"])


def _agreement(spec: str, plain: str) -> str:
    """How far the two texts agree. Greedy speculation is token-identical to plain decoding in float32, and in
    bfloat16 with the target's forwards batch invariant (`target_pool.deterministic`, on by default for a
    bfloat16 CPU target; docs/design.md); with the libraries' kernels a bfloat16 verify rounds unlike a
    one-token step, so a near-tie between two tokens can fall the other way."""
    if spec == plain:
        return "the same text"
    common = next((i for i, (a, b) in enumerate(zip(spec, plain, strict=False)) if a != b), min(len(spec), len(plain)))
    return (
        f"the texts agree for their first {common} of {len(plain)} characters (a bfloat16 target without "
        "`target_pool.deterministic` rounds a several-token verify unlike a one-token step, so a near-tie can "
        "fall the other way)"
    )


def reserved_cpus(args: dict[str, Any]) -> float:
    """Logical CPUs the config's starting replicas reserve (each sets its own torch threads)."""
    from deploy.config import AppConfig

    config = AppConfig.model_validate(args)
    draft, target, router = config.draft_pool, config.target_pool, config.router_pool

    def start(pool: Any) -> int:
        return max(pool.autoscaling.min_replicas, pool.autoscaling.initial_replicas or 1)

    need = router.num_cpus * start(router)
    need += (target.shard_num_cpus * config.tp_size + target.replica_num_cpus) * start(target)
    if config.draft_model is not None:
        need += draft.num_cpus * start(draft)
    return need


def _logical_cpus(args: dict[str, Any]) -> int:
    """Enough logical CPUs for the config's starting replicas, and at least this machine's cores."""
    return max(os.cpu_count() or 1, math.ceil(reserved_cpus(args)))


def _session_logs() -> str:
    try:
        import ray

        node: Any = ray._private.worker._global_node
        return str(Path(node.get_session_dir_path()) / "logs")
    except Exception:  # a Ray without that private path: its documented default
        return "/tmp/ray/session_latest/logs"


def _bindable(port: int) -> int:
    """`port` if it is free, else one the kernel picks: Ray's start fails, after 30 s and with a message
    naming no port, when its metrics agent cannot bind."""
    for candidate in (port, 0):
        with socket.socket() as s:
            try:
                s.bind(("", candidate))
            except OSError:
                continue
            free: int = s.getsockname()[1]
        if free != port:
            print(f"port {port} is in use: Prometheus metrics on {free} instead", file=sys.stderr)
        return free
    raise OSError("no free port for Ray's metrics agent")


def start_local_ray(args: dict[str, Any], apps: int = 1, metrics_port: int = METRICS_PORT) -> str:
    """Ray embedded in this process, with CPUs for `apps` applications of the config's replicas, off the
    target's `cpu_cores` and its workers at niceness 0; its log lines go to its folder. Returns the URL
    of its Prometheus endpoint (Ray's metrics agent on `metrics_port`, or another port where that one
    is taken: specserve's metrics beside Ray's and Serve's, docs/metrics.md)."""
    import ray

    from deploy.front.proxy_guard import PROXY_CALLBACK, PROXY_CALLBACK_ENV

    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)  # Serve's proxies (started by this Ray) read it
    _leave_target_cores(args)
    metrics_port = _bindable(metrics_port)
    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, apps * _logical_cpus(args)),
        include_dashboard=False,
        runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}},
        log_to_driver=False,  # the replicas' lines stay in Ray's session folder (printed below)
        logging_level=logging.WARNING,
        _metrics_export_port=metrics_port,  # `ray start --metrics-export-port`, as on a cluster
        # Ray starts its workers at niceness 15, every replica below Ray's own daemons; at 0 the draft pool's
        # `nice` ranks the draft below the target and the router instead (docs/design.md).
        _system_config={"worker_niceness": 0},
    )
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    print(f"Ray and Serve log to {_session_logs()}", file=sys.stderr)
    print(f"Prometheus metrics: {metrics} (docs/metrics.md)", file=sys.stderr)
    return metrics


_driver_cores: set[int] | None = None  # this process's cores before `_leave_target_cores` moved it


def _leave_target_cores(args: dict[str, Any]) -> None:
    """With `target_pool.cpu_cores` set, this process (the driver) moves to the other cores before Ray
    starts, so Ray's processes, Serve's and the draft's, which all inherit its cores, leave the target
    shard's to it (actors/cpu_cores.py). `stop_local_ray` moves it back. Nothing where no core is left."""
    global _driver_cores
    from actors.cpu_cores import pin_process, usable_cores
    from deploy.config import AppConfig

    target = AppConfig.model_validate(args).target_pool.cpu_cores
    before = usable_cores()
    rest = before - set(target or ())
    if target and rest and pin_process(rest):
        _driver_cores = before


def stop_local_ray() -> None:
    """Shut Serve and the embedded Ray down. What they report on the way (Ray prints an actor killed
    mid-call, such as Serve's controller, on the driver's stdout) goes to Ray's log folder with their
    other lines, not into the demo's output."""
    import ray
    from ray import serve

    logs = Path(_session_logs())
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "shutdown.log", "a") as sink, contextlib.redirect_stdout(sink):
        serve.shutdown()
        ray.shutdown()
    global _driver_cores
    if _driver_cores is not None:
        from actors.cpu_cores import pin_process

        pin_process(_driver_cores)
        _driver_cores = None


def deploy_local(
    args: dict[str, Any], port: int, grpc_options: dict[str, Any] | None = None, name: str = "specserve"
) -> str:
    """Serve on this machine's Ray, the application of `args` deployed as `name` (at / for the default name,
    else at /<name>); its base URL once every replica has loaded (progress shown meanwhile)."""
    from ray import serve

    from deploy.app import app_builder

    serve.start(http_options={"host": "127.0.0.1", "port": port}, grpc_options=grpc_options or None)
    # serve.run returns once every replica has loaded its model: run it aside, show progress here.
    errors: list[BaseException] = []
    prefix = "/" if name == "specserve" else f"/{name}"

    def run() -> None:
        try:
            serve.run(app_builder(args), name=name, route_prefix=prefix)
        except BaseException as e:  # shown by wait_ready, in the caller's thread
            errors.append(e)

    deploying = threading.Thread(target=run, daemon=True)
    deploying.start()
    url = f"http://127.0.0.1:{port}{prefix.rstrip('/')}"
    wait_ready(url, timeout_s=1800, failed=lambda: errors[0] if errors else None)
    deploying.join()
    return url


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def serve_demo(
    config_path: Path,
    prompt: str,
    max_tokens: int,
    keep_running: bool,
    port: int = 8000,
    metrics_port: int = METRICS_PORT,
    overrides: dict[str, Any] | None = None,
) -> int:
    """`specserve serve`: the application of `config_path` (its args with `overrides` merged in, nested dicts key
    by key; a `drafter` block replaces the config's) on an embedded Ray, one request streamed with and without
    speculation, their report."""
    grpc_options, args = app_block(config_path)
    args = with_overrides(args, overrides or {})
    for key in ("target_model", "draft_model"):
        if args.get(key) in REGISTRY:
            fetch(args[key])
    metrics = start_local_ray(args, metrics_port=metrics_port)
    # SIGTERM (a service manager, `kill`) stops the run as Ctrl-C does: through the `finally` below, which shuts
    # Ray down with every process it started. Set after Ray starts: Ray's own handler aborts the driver, and its
    # dashboard and runtime-env agents outlived the run.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        url = deploy_local(args, port, grpc_options)
        model = args.get("front_door", {}).get("served_model_name", args["target_model"])
        stream_chat(url, model, prompt, 8, speculate=True, show=False)  # warm-up: the first forwards are slower
        print(f"\n> {prompt}\n", file=sys.stderr)
        spec = stream_chat(url, model, prompt, max_tokens, speculate=True, show=True)
        print("\n\n(the same request again, max_draft_tokens: 0: plain decoding)", file=sys.stderr)
        plain = stream_chat(url, model, prompt, max_tokens, speculate=False, show=False)
        print("\n" + _report(spec, plain), file=sys.stderr)
        if keep_running:
            print(
                f"\nserving {model}: {url}/v1 (OpenAI), "
                + (f"gRPC on :{grpc_options.get('port', 9000)}, " if grpc_options else "")
                + f"metrics on {metrics}; Ctrl-C stops",
                file=sys.stderr,
            )
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        stop_local_ray()
    return 0
