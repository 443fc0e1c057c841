"""`make run`'s demo (`python -m deploy.local.cli serve`) prints the answer and its report, and nothing of Ray's.

Run as a user runs it, in its own process: `specserve serve smollm2-135m --drafter lookup` (SmolLM2-135M,
prompt lookup: the quickest real deployment), and on deploy/smoke.yaml; only its ports are moved. Ray reports
an actor killed mid-call (Serve's controller, at shutdown) on the driver's stdout: such lines belong in Ray's
log folder.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

from tests.actors.serve_helpers import free_port, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


def test_the_demo_prints_its_answer_and_report_and_no_ray_lines() -> None:
    """The one-liner form, `specserve serve MODEL --drafter lookup`: deploy/local.yaml's settings with the
    model replaced (SmolLM2, whose quickest deployment drafts by prompt lookup alone)."""
    command = [sys.executable, "-m", "deploy.local.cli", "serve", "smollm2-135m", "--drafter", "lookup"]
    command += ["--max-tokens", "16"]
    command += ["--port", str(free_port()), "--metrics-port", str(free_port())]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "speculation:" in done.stderr and "acceptance length" in done.stderr, done.stderr[-2000:]
    assert done.stdout.strip(), "the streamed answer"
    ray_lines = [x for x in (done.stdout + done.stderr).splitlines() if "(raylet)" in x or "pid=" in x]
    assert not ray_lines, ray_lines


def test_sigterm_stops_the_server_and_every_process_it_started(tmp_path: Path) -> None:
    """`serve --keep-running` stopped by SIGTERM, as a service manager stops it: it exits, and no process of the
    run is left (before, Ray's dashboard and runtime-env agents outlived it)."""
    config = yaml.safe_load((REPO / "deploy" / "smoke.yaml").read_text())
    path = tmp_path / "smoke.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    command = [sys.executable, "-m", "deploy.local.cli", "serve", "--config", str(path), "--max-tokens", "8"]
    command += ["--port", str(port), "--metrics-port", str(free_port()), "--keep-running"]
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        assert wait_until(lambda: "Ctrl-C stops" in (tmp_path / "serve.log").read_text(), 420, every_s=2), (
            tmp_path / "serve.log"
        ).read_text()[-2000:]
        run = psutil.Process(server.pid).children(recursive=True)
        assert run, "the run's processes (Ray's, Serve's, the replicas)"
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=120) == 0
        _, alive = psutil.wait_procs(run, timeout=30)
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        if server.poll() is None:
            server.kill()
        log.close()
