"""Our C kernels (`kernels/*.c`): built when the package is installed, loaded here with ctypes by their modules
(`int4_vnni`, `int8_avx2`, `kquant`, `attention`).

setup.py makes each kernel of `BUILDS` an optional extension: `pip install .` (a wheel) and `pip install -e .`
(`make setup`; beside the sources) compile it with the system C compiler, and a missing compiler or a failed build
leaves that kernel out with a warning while the install goes on. A build is named by its source's and flags'
hash (`module`), so a checkout whose C changed after its install finds no build for it until it is built again
(`pip install -e .`, or `python setup.py build_ext --inplace`). Where a kernel is not built, or this CPU lacks
its instruction sets, `library` is None and its caller runs torch's path.

May import: the standard library only (setup.py loads this file by its path, before anything is installed).
"""

from __future__ import annotations

import ctypes
import hashlib
import sysconfig
import warnings
from pathlib import Path
from typing import Any, NamedTuple

KERNELS = Path(__file__).with_name("kernels")
PACKAGE = "speculative.engine.cpu.kernels"  # the builds' module path (a folder of sources, not a package)
AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16", "-mfma", "-mf16c")
AVX512_CPU = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "f16c"})  # /proc/cpuinfo's
AVX2_FLAGS = ("-mavx2", "-mfma")
AVX2_CPU = frozenset({"avx2", "fma"})


class Build(NamedTuple):
    """A kernel's instruction sets (compiler flags, and the CPU flags it then needs), its compiler flags beyond
    -O3 and those, its linker flags, and the headers of kernels/ it includes."""

    isa: tuple[str, ...] = AVX512_FLAGS
    cpu: frozenset[str] = AVX512_CPU
    flags: tuple[str, ...] = ()
    link: tuple[str, ...] = ()
    headers: tuple[str, ...] = ()


# the GGUF weights' kernels: threads through OpenMP, float steps as written (no contracted FMAs), one driver
GGUF: dict[str, Any] = {
    "flags": ("-fopenmp", "-ffp-contract=off"),
    "link": ("-fopenmp",),
    "headers": ("kquant_common.h", "kquant_pack.h"),
}
BUILDS = {  # kernels/<name>.c -> how it builds
    "int4_vnni": Build(),
    "int8_avx2": Build(isa=AVX2_FLAGS, cpu=AVX2_CPU),
    "kquant_vnni": Build(**GGUF),
    "kquant_avx2": Build(isa=(*AVX2_FLAGS, "-mf16c"), cpu=AVX2_CPU | {"f16c"}, **GGUF),
    # batch invariance: no fused multiply-adds the compiler's order decides
    "attention": Build(flags=("-ffp-contract=off",), headers=("attention_common.h",)),
    "attention_avx2": Build(
        isa=AVX2_FLAGS, cpu=AVX2_CPU, flags=("-ffp-contract=off",), headers=("attention_common.h",)
    ),
}


def compile_args(name: str) -> list[str]:
    """After Python's own CFLAGS, which setuptools puts first: -fno-wrapv undoes their -fwrapv."""
    return ["-O3", "-fno-wrapv", *BUILDS[name].isa, *BUILDS[name].flags]


def module(name: str) -> str:
    """Kernel `name`'s extension module under PACKAGE: `<name>_<hash of its source, headers and flags>`."""
    build = " ".join([*compile_args(name), *BUILDS[name].link]).encode()
    sources = [KERNELS / f"{name}.c", *(KERNELS / header for header in BUILDS[name].headers)]
    return f"{name}_{hashlib.sha256(b''.join(p.read_bytes() for p in sources) + build).hexdigest()[:16]}"


def cpu_supports(needed: frozenset[str] = AVX512_CPU) -> bool:
    """Whether this CPU has every instruction set in `needed` (Linux's /proc/cpuinfo flags)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return set(flags) >= needed


Signature = tuple[list[Any], Any]  # a C function's ctypes argument types and result type


def library(name: str, what: str, functions: dict[str, Signature]) -> ctypes.CDLL | None:
    """Kernel `name` as the install built it, with its `functions` typed; None where this CPU lacks the
    instruction sets, or (with a warning naming `what`) where no build of this source is installed."""
    if not cpu_supports(BUILDS[name].cpu):
        return None
    path = KERNELS / f"{module(name)}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not path.exists():
        warnings.warn(
            f"{what}: its kernel is not built for this source ({path.name}: pip install -e ., or python setup.py "
            "build_ext --inplace, with a C compiler); torch's path runs",
            stacklevel=2,
        )
        return None
    lib = ctypes.CDLL(str(path))
    for function_name, (arguments, result) in functions.items():
        function = getattr(lib, function_name)
        function.argtypes, function.restype = arguments, result
    return lib


def rows_for(lib: ctypes.CDLL | None, kernel: str, rows: Any, dtype: Any) -> tuple[ctypes.CDLL, Any]:
    """(`lib`, `rows` contiguous) for a call of `kernel`, which takes `dtype` rows on the CPU: raises where the
    kernel cannot run here (`lib` None) or the rows are not what it takes. (`rows`: a torch tensor; this file
    imports the standard library only.)"""
    if lib is None:
        raise RuntimeError(f"the {kernel} kernel cannot run on this machine")
    if rows.dtype != dtype or rows.device.type != "cpu":
        raise ValueError(f"the {kernel} kernel takes {dtype} rows on the CPU, not {rows.dtype} on {rows.device}")
    return lib, rows.contiguous()
