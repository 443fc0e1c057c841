"""A wheel built from the tree carries the gRPC stubs: installed into a fresh virtual environment, it imports them.

The stubs are git-ignored (`make proto` writes them for an editable checkout); setup.py's build step generates
them into the built package. The tree is copied without them, so the wheel's can only come from its build;
the venv sees this environment's packages (`--system-site-packages`: no torch download) and the wheel is
installed with `--no-deps`; the import runs from a folder outside the repository.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("speculative", "actors", "deploy", "modelstore", "proto", "bench")
STUBS = {"proto/specserve_pb2.py", "proto/specserve_pb2.pyi", "proto/specserve_pb2_grpc.py", "proto/specserve.proto"}


def _copy_tree_without_stubs(dest: Path) -> Path:
    src = dest / "src"
    skip = shutil.ignore_patterns("__pycache__", "*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py", "results")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package, ignore=skip)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    return src


def _run(*args: str | Path, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{args}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_a_wheel_built_from_the_tree_installs_importable_grpc_stubs(tmp_path: Path) -> None:
    src = _copy_tree_without_stubs(tmp_path)
    dist = tmp_path / "dist"
    _run(sys.executable, "-m", "pip", "wheel", src, "--no-deps", "--no-build-isolation", "-q", "-w", dist, cwd=tmp_path)
    (wheel,) = dist.glob("specserve-*.whl")
    assert set(zipfile.ZipFile(wheel).namelist()) >= STUBS

    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=True)
    python = env_dir / "bin" / "python"
    _run(python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel, cwd=tmp_path)
    probe = (
        "import proto.specserve_pb2_grpc as g; from proto import specserve_pb2 as pb; "
        "r = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role='user', content='hi')])); "
        "print(g.__file__); print(r.WhichOneof('prompt')); print(g.SpecServeStub.__name__)"
    )
    where, prompt, stub = _run(python, "-c", probe, cwd=tmp_path).split()
    assert Path(where).is_relative_to(env_dir), where  # the wheel's stubs, not this checkout's
    assert (prompt, stub) == ("chat", "SpecServeStub")
