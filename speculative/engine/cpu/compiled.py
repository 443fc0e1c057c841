"""Our C kernels' build: compiled once per machine with the system C compiler into `SPECSERVE_KERNELS` (default
`~/.cache/specserve/kernels`), keyed by the source's hash and flags, and loaded with ctypes by their modules
(`int4_vnni`, `kquant`). No compiler, a failed build or a CPU without the instruction sets leaves them None."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Any

KERNELS = Path(__file__).with_name("kernels")
AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16", "-mfma", "-mf16c"]
AVX512_CPU = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "f16c"}  # as /proc/cpuinfo names them


def cpu_supports(needed: set[str] = AVX512_CPU) -> bool:
    """Whether this CPU has every instruction set in `needed` (Linux's /proc/cpuinfo flags)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return set(flags) >= needed


def folder() -> Path:
    return Path(os.environ.get("SPECSERVE_KERNELS", Path.home() / ".cache" / "specserve" / "kernels"))


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(source: Path, flags: list[str], into: Path, cc: str | None, what: str) -> Path | None:
    """`source`'s shared library in `into`, compiled there unless this source and these flags already were;
    None (with a warning naming `what` and why) where `cc` is missing or fails."""
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    path = into / f"{source.stem}-{digest}.so"
    if path.exists():
        return path
    if cc is None:
        warnings.warn(f"{what}: no C compiler (cc, gcc or $CC), its kernel is not built", stacklevel=2)
        return None
    into.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=into) as tmp:  # built aside, then renamed: replicas build at once
        built = Path(tmp) / path.name
        try:
            run = subprocess.run([cc, *flags, "-o", str(built), str(source)], capture_output=True, text=True)
            error = run.stderr.strip()[:500] if run.returncode else None
        except OSError as e:
            error = repr(e)
        if error is not None:
            warnings.warn(f"{what}: the kernel did not build ({error})", stacklevel=2)
            return None
        os.replace(built, path)
    return path


Signature = tuple[list[Any], Any]  # a C function's ctypes argument types and result type


def library(source: Path, flags: list[str], what: str, functions: dict[str, Signature]) -> ctypes.CDLL | None:
    """`source` built here (`build`) and loaded with its `functions` typed; None where this CPU lacks the
    instruction sets or the kernel cannot be built (the caller falls back, `what` names it in the warning)."""
    if not cpu_supports():
        return None
    path = build(source, flags, folder(), compiler(), what)
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    for name, (arguments, result) in functions.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = arguments, result
    return lib
