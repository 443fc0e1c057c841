"""The CPU dry runs of the GPU benchmark (`bash bench/gpu.sh`'s code, the served application included) and the
overhead benchmark: every code path runs, outputs stay exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_module(module: str, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, check=True, timeout=600)


def test_gpu_bench_tiny_runs_every_section_exactly(tmp_path: Path) -> None:
    run_module("bench.gpu", "--tiny", "--out", str(tmp_path), "--acceptances", "0.8", "--ks", "2,4")
    results = json.loads((tmp_path / "gpu.json").read_text())
    failed = {k: v for k, v in results.items() if isinstance(v, dict) and "error" in v}
    assert not failed
    assert results["bound"]["bound_tokens_per_s"] > 0
    assert all(
        row["exact"] == f"{results['args']['prompts']}/{results['args']['prompts']}" for row in results["oracle"]
    )
    assert all(row["exact"].split("/")[0] == row["exact"].split("/")[1] for row in results["batch"])
    served = results["served"]  # the application on a local Ray, its drafts from real agreeing draft models
    for row in ("near_free", "draft_round_ahead", "draft_sequential"):
        assert served[row]["exact"] is True and 0.3 < served[row]["acceptance"] < 1.0, (row, served[row])
    assert served["plain"]["tokens_per_s"] > 0 and served["batch"]["batch"] == 4
    assert "## Headline" in (tmp_path / "gpu.md").read_text()
    assert "## The served application" in (tmp_path / "gpu.md").read_text()


def test_overhead_bench_reports_every_shape(tmp_path: Path) -> None:
    run_module("bench.overhead", "--out", str(tmp_path), "--steps", "5", "--batches", "1", "3")
    rows = json.loads((tmp_path / "overhead.json").read_text())["rows"]
    assert [(r["batch"], r["draft_tokens"]) for r in rows] == [(1, 0), (1, 4), (3, 0), (3, 4)]
    assert all(r["step_ms"] > 0 and r["host_ms"] > 0 for r in rows)
    assert (tmp_path / "overhead.png").exists()
