"""`make run`'s demo (`python -m deploy.local.cli serve`) prints the answer and its report, and nothing of Ray's.

Run as a user runs it, in its own process, on deploy/smoke.yaml (SmolLM2-135M, prompt lookup: the
quickest real deployment); only its ports are moved. Ray reports an actor killed mid-call (Serve's
controller, at shutdown) on the driver's stdout: such lines belong in Ray's log folder.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.actors.serve_helpers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


def test_the_demo_prints_its_answer_and_report_and_no_ray_lines(tmp_path: Path) -> None:
    config = yaml.safe_load((REPO / "deploy" / "smoke.yaml").read_text())
    config["grpc_options"]["port"] = free_port()
    path = tmp_path / "smoke.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "deploy.local.cli", "serve", "--config", str(path), "--max-tokens", "16"]
    command += ["--port", str(free_port()), "--metrics-port", str(free_port())]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "speculation:" in done.stderr and "acceptance length" in done.stderr, done.stderr[-2000:]
    assert done.stdout.strip(), "the streamed answer"
    ray_lines = [x for x in (done.stdout + done.stderr).splitlines() if "(raylet)" in x or "pid=" in x]
    assert not ray_lines, ray_lines
