"""The AVX-512 VNNI kernel for 4-bit draft weights (`kernels/int4_vnni.c`): its build, its layout, its call.

torch's weight-only int4 kernel dequantizes every weight to bfloat16 before it multiplies, so on one core a
decode-sized call reads its weights at about two thirds of the rate the core can stream them. This kernel
quantizes the few activation rows to int8 instead and multiplies the 4-bit weights as bytes (VPDPBUSD), so a
call streams its weights once at about the memory's rate (`bench/results/draft_quantize.md`). It is a draft's
kernel: int8 activations change a draft's logits by about 1 %, which changes how many drafts are accepted,
never the output.

The C source is compiled once per machine with the system C compiler into `SPECSERVE_KERNELS` (default
`~/.cache/specserve/kernels`), keyed by the source's hash, and loaded with ctypes; no compiler, a failed
build or a CPU without AVX-512 VNNI and BF16 leaves `library()` None, and `Int4Linear` then uses torch's.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("kernels") / "int4_vnni.c"
FLAGS = ["-O3", "-shared", "-fPIC", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16", "-mfma"]
CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}  # as /proc/cpuinfo names them
TILE, GROUP, MAX_ROWS = 16, 32, 8  # as in the C source


def cpu_supports() -> bool:
    """Whether this CPU has every instruction set the kernel is compiled for (Linux's /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return set(flags) >= CPU_FLAGS


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, built here on first use; None where this machine cannot run or build it."""
    if not cpu_supports():
        return None
    folder = Path(os.environ.get("SPECSERVE_KERNELS", Path.home() / ".cache" / "specserve" / "kernels"))
    path = build(folder, os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    pointer, count = ctypes.c_void_p, ctypes.c_int
    lib.int4_vnni_mm.argtypes = [pointer, count, count, pointer, count, pointer]  # W, out, in, x, rows, y
    lib.int4_vnni_mm.restype = ctypes.c_int
    return lib


def build(folder: Path, compiler: str | None) -> Path | None:
    """The kernel's shared library in `folder`, compiled there unless this source was already; None (with a
    warning saying why) where `compiler` is missing or fails."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    path = folder / f"int4_vnni-{digest}.so"
    if path.exists():
        return path
    if compiler is None:
        warnings.warn("int4 draft weights: no C compiler (cc, gcc or $CC), using torch's int4 kernel", stacklevel=2)
        return None
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # built aside, then renamed: replicas build at once
        built = Path(tmp) / path.name
        try:
            run = subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE)], capture_output=True, text=True)
            error = run.stderr.strip()[:500] if run.returncode else None
        except OSError as e:
            error = repr(e)
        if error is not None:
            warnings.warn(f"int4 draft weights: the kernel did not build ({error}), using torch's", stacklevel=2)
            return None
        os.replace(built, path)
    return path


def pack(levels: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of weights `scale * levels + low` per group: levels [out, in] (0..15), scale and
    low [out, in / GROUP] -> [tiles, in / GROUP, 320] uint8 (outputs padded to whole tiles of 16)."""
    out, inp = levels.shape
    groups, tiles = inp // GROUP, -(-out // TILE)
    pad = tiles * TILE - out
    levels = torch.nn.functional.pad(levels.to(torch.uint8), (0, 0, 0, pad))  # [tiles * 16, in]
    scale, low = (torch.nn.functional.pad(t.float(), (0, 0, 0, pad)) for t in (scale, low))  # [tiles * 16, G]
    split = levels.reshape(tiles, TILE, groups, 4, 2, 4)  # [tile, lane, group, chunk, low/high nibble, byte]
    nibbles = (split[:, :, :, :, 0] | (split[:, :, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)  # [T, G, chunk, lane, b]

    def per_tile(t: torch.Tensor) -> torch.Tensor:  # [tiles * 16, G] -> [T, G, 32] bytes of bfloat16
        return t.reshape(tiles, TILE, groups).transpose(1, 2).to(torch.bfloat16).contiguous().view(torch.uint8)

    return torch.cat([nibbles.reshape(tiles, groups, 256), per_tile(scale), per_tile(low)], dim=-1).contiguous()


def matmul(packed: torch.Tensor, out: int, rows: torch.Tensor) -> torch.Tensor:
    """rows [M, in] bfloat16 (1 <= M <= MAX_ROWS) -> [M, out] bfloat16 through weights `pack` laid out."""
    lib = library()
    if lib is None:
        raise RuntimeError("the int4 VNNI kernel cannot run on this machine")
    if rows.dtype != torch.bfloat16 or rows.device.type != "cpu":
        raise ValueError(f"the int4 VNNI kernel takes bfloat16 rows on the CPU, not {rows.dtype} on {rows.device}")
    rows = rows.contiguous()
    y = torch.empty(rows.shape[0], out, dtype=torch.bfloat16)  # [M, out]
    if lib.int4_vnni_mm(packed.data_ptr(), out, rows.shape[1], rows.data_ptr(), rows.shape[0], y.data_ptr()):
        raise RuntimeError(f"int4 kernel refused {rows.shape[0]} rows of {rows.shape[1]} inputs")
    return y
