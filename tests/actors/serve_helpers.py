"""Local Ray + Serve for the actor tests: one Ray start per test module, apps deployed from AppConfig."""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray
import yaml
from ray import serve
from ray._private.state import actors as gcs_actors  # the GCS's table: needs no dashboard
from ray.serve.deployment import Application
from ray.serve.handle import DeploymentHandle

from deploy.app import build_app
from deploy.config import AppConfig
from deploy.local.demo import merged_args

REPO = str(Path(__file__).resolve().parents[2])
APP = "specserve"
# Ray workers import the repo through PYTHONPATH (no working_dir upload).
WORKER_ENV = {"PYTHONPATH": REPO, "TOKENIZERS_PARALLELISM": "false"}


merged = merged_args  # `base` with `overrides` merged in, nested dicts key by key


def deploy_yaml(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """The Serve config `deploy/<name>` with `args` merged into its one application's args."""
    config = yaml.safe_load((Path(REPO) / "deploy" / name).read_text())
    (app,) = config["applications"]
    app["args"] = merged(app["args"], args)
    return config


STARTUP_TIMEOUTS = ("timed out during startup", "Timed out waiting for file")  # raylet; GCS port file


@contextmanager
def local_ray(**init: Any) -> Iterator[None]:
    """Ray on this machine; workers import the repo through PYTHONPATH (no working_dir upload).

    Ray waits a fixed 30 s for its raylet to register, and a while for its GCS server to write the
    port it listens on; on a busy 2-core machine each once did not come (CI: `test_placement`; the
    GCS of `test_front_doors`, started right after another module's Ray shut down, left no log at
    all), so a start that timed out is retried once.
    """
    for attempt in (1, 2):
        try:
            ray.init(
                address="local",  # a fresh instance, even if a `ray start` cluster runs on this machine
                include_dashboard=False,
                runtime_env={"env_vars": WORKER_ENV},
                **init,
            )
            break
        except Exception as e:
            if attempt == 2 or not any(m in str(e) for m in STARTUP_TIMEOUTS):
                raise
            ray.shutdown()
            time.sleep(2.0)  # what the last instance left behind finishes going
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def run_app(
    app: Application, route_prefix: str | None = None, timeout_s: float = 300.0, attempts: int = 1
) -> DeploymentHandle:
    """`serve.run(app)` bounded by `timeout_s` (Serve waits forever), failing with what was not up.

    CI once saw a deploy on a simulated multi-node cluster never reach RUNNING, with no message but
    the test's timeout. Here a deploy that is not up in time is reported (the stuck deployments,
    pending actors and placement groups, free resources); with `attempts` > 1 the report becomes a
    warning, the app is deleted and deployed afresh.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, not {attempts}")
    for attempt in range(1, attempts + 1):
        handle = _run_within(app, route_prefix, timeout_s)
        if handle is not None:
            return handle
        report = f"app {APP!r} not RUNNING after {timeout_s:.0f} s (attempt {attempt}/{attempts}):\n"
        report += not_running_report()
        if attempt < attempts:
            warnings.warn(report, stacklevel=2)
            serve.delete(APP)
    raise AssertionError(report)


def _run_within(app: Application, route_prefix: str | None, timeout_s: float) -> DeploymentHandle | None:
    """`serve.run` in a daemon thread: its handle, its error raised here, or None if still waiting."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["handle"] = serve.run(app, name=APP, route_prefix=route_prefix)
        except BaseException as e:  # handed to the caller below
            result["error"] = e

    runner = threading.Thread(target=run, name="serve.run", daemon=True)
    runner.start()
    runner.join(timeout_s)
    if "error" in result:
        raise result["error"]
    handle: DeploymentHandle | None = result.get("handle")
    return handle


def not_running_report() -> str:
    """The app's deployments, actors pending or restarting, unplaced placement groups, the cluster's
    free resources and each node's total."""
    lines = []
    app = serve.status().applications.get(APP)
    if app is not None:
        lines.append(f"app {app.status}: {app.message}")
        for name, d in app.deployments.items():
            lines.append(f"  deployment {name} {d.status} replicas {dict(d.replica_states)}: {d.message}")
    for actor in gcs_actors().values():
        if actor["State"] not in ("ALIVE", "DEAD"):
            lines.append(f"  actor {actor['ActorClassName']} {actor['Name']!r} {actor['State']}")
    for group in ray.util.placement_group_table().values():
        if group["state"] != "CREATED":
            lines.append(f"  placement group {group['name']!r} {group['state']} bundles {group['bundles']}")
    lines.append(f"  free resources {ray.available_resources()}")
    for node in ray.nodes():
        lines.append(f"  node {node['NodeID']} alive={node['Alive']} resources {node['Resources']}")
    return "\n".join(lines)


@contextmanager
def deployed(config: AppConfig) -> Iterator[DeploymentHandle]:
    handle = run_app(build_app(config))
    try:
        yield handle
    finally:
        serve.delete(APP)


# Ports for servers a test starts after Ray: above Ray's worker ports (10002-19999) and below the
# kernel's ephemeral range (32768+), which outgoing connections and port-0 binds draw from. A port the
# kernel handed out was taken by one of Ray's processes before Serve's gRPC proxy bound it (CI:
# "Failed to bind to address [::]:44217").
_PORTS = range(20000, 32768)
_handed_out: set[int] = set()  # two calls before either server binds must not get the same port


def free_port() -> int:
    """A port free now (on every interface) that Ray and the kernel will not hand to anyone else."""
    for port in random.sample(_PORTS, 256):
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {_PORTS.start}-{_PORTS.stop - 1}")


def replicas(deployment: str, states: tuple[str, ...] = ("RUNNING", "STARTING")) -> int:
    """Replicas of a deployment of the app in these states (STARTING counts: Serve decided to scale)."""
    status = serve.status().applications[APP].deployments[deployment]
    return sum(n for state, n in status.replica_states.items() if str(getattr(state, "value", state)) in states)


def wait_until(predicate: Any, timeout_s: float, every_s: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every_s)
    return predicate()


async def gather_generate(handle: DeploymentHandle, requests: list[tuple[list[int], dict[str, Any]]]) -> list[dict]:
    return list(await asyncio.gather(*[handle.generate.remote(p, sp) for p, sp in requests]))


def small_cpu_args(target: Path, draft: Path, served_model_name: str) -> dict[str, Any]:
    """Overrides that shrink a deploy/ YAML's application to tiny fp32 models and fractional CPUs."""
    return {
        "target_model": str(target),
        "draft_model": str(draft),
        "dtype": "float32",
        "torch_threads": 1,
        # open: the tests' Serve proxies listen on loopback, but gRPC's on every interface (deploy/front/exposure.py)
        # of a test machine of their own
        "front_door": {"served_model_name": served_model_name, "open": True},
        "draft_pool": {"num_cpus": 0.5},
        "target_pool": {"shard_num_cpus": 0.5},
        "router_pool": {"num_cpus": 0.25},
    }
