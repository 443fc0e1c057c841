"""Writing benchmark results: JSON + a markdown table + PNG plots under bench/results/, with the machine."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        cpu = platform.processor()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    kinds = (("amx_tile", "AMX"), ("avx512_bf16", "AVX-512 BF16"), ("avx2", "AVX2"))  # the first this CPU has
    isa = next((name for flag, name in kinds if flag in flags), "?")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    try:  # "-dirty": the run's tree held uncommitted changes to tracked files, so the commit is not what ran
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "cpu": cpu,
        "isa": isa,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": commit,
    }


def markdown_table(columns: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def earlier_run(path: Path | str) -> tuple[argparse.Namespace, list[dict[str, Any]], dict[str, Any]]:
    """An earlier run's arguments, rows and machine from its JSON (`--render`: md/png again, no measuring)."""
    earlier = json.loads(Path(path).read_text())
    return argparse.Namespace(**{**earlier["config"], "render": None}), earlier["rows"], earlier["machine"]


def write(
    name: str, data: dict[str, Any], markdown: str, folder: Path = RESULTS, measured_on: dict[str, Any] | None = None
) -> Path:
    """<folder>/<name>.json and .md (bench/results/ by default), stamped with the machine the figures were
    measured on (this one unless `measured_on` says otherwise); returns the path stem for plots (<name>.png)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = {"machine": measured_on or machine(), **data}
    (folder / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    info = data["machine"]
    isa = f" ({info['isa']})" if info.get("isa") else ""  # (results measured before the field have none)
    header = f"Machine: {info['cpu']}{isa}, {info['cores']} cores, torch threads {info['torch_threads']}"
    header += f", GPU {info['gpu']}" if info["gpu"] else ", no GPU"
    header += f"; commit {info['commit']}.\n\n"
    (folder / f"{name}.md").write_text(f"# {name}\n\n{header}{markdown}\n")
    return folder / name


def summary_table(summary: dict[str, Any]) -> str:
    """A run's summary figures as a two-column markdown table (floats to 3 places)."""
    lines = (f"| {k} | {v:.3f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in summary.items())
    return "| summary (all prompts' tokens over their seconds) | value |\n|---|---|\n" + "\n".join(lines) + "\n\n"
