"""Our C kernels are built when the package is installed (setup.py, speculative/engine/cpu/compiled.py), never
at first use: each kernels/*.c an optional extension named by its source's hash."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from speculative.engine.cpu import attention, compiled, int4_vnni, int8_avx2, kquant

ROOT = Path(__file__).resolve().parents[2]
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")


def test_every_kernel_source_has_a_build_named_by_its_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each C source in kernels/ is in BUILDS; a changed source gets another module name, so a build of the
    old source is not loaded for it."""
    assert set(compiled.BUILDS) == {path.stem for path in compiled.KERNELS.glob("*.c")}
    before = compiled.module("int4_vnni")
    assert before.startswith("int4_vnni_")
    shutil.copytree(compiled.KERNELS, tmp_path, dirs_exist_ok=True)
    with (tmp_path / "int4_vnni.c").open("a") as source:
        source.write("\n/* changed */\n")
    monkeypatch.setattr(compiled, "KERNELS", tmp_path)
    assert compiled.module("int4_vnni") != before
    # a header the GGUF kernels share renames both builds
    shared = {name: compiled.module(name) for name in ("kquant_vnni", "kquant_avx2")}
    with (tmp_path / "kquant_common.h").open("a") as header:
        header.write("\n/* changed */\n")
    assert all(compiled.module(name) != module for name, module in shared.items())


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here")
def test_setup_builds_every_kernel_and_a_missing_one_is_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """setup.py's build_ext compiles every kernel under its module name (into a scratch folder here, as a wheel's
    build does); loaded from there each has its functions, and a kernel with no build for its source is None
    with a warning naming it, nothing raises (its caller then runs torch's path)."""
    lib, temp = tmp_path / "lib", tmp_path / "temp"
    built = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "-b", str(lib), "-t", str(temp)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    folder = lib / "speculative" / "engine" / "cpu" / "kernels"
    assert {path.name for path in folder.glob("*.so")} == {f"{compiled.module(n)}{SUFFIX}" for n in compiled.BUILDS}
    for source in [*compiled.KERNELS.glob("*.c"), *compiled.KERNELS.glob("*.h")]:
        shutil.copy(source, folder)  # as a wheel holds them: the package data beside the builds
    monkeypatch.setattr(compiled, "KERNELS", folder)
    monkeypatch.setattr(compiled, "cpu_supports", lambda needed=compiled.AVX512_CPU: True)  # loading runs none
    assert compiled.library("int4_vnni", "int4 draft weights", {"int4_vnni_mm": ([], None)}) is not None
    (folder / f"{compiled.module('attention')}{SUFFIX}").unlink()
    with pytest.warns(UserWarning, match="invariant attention: its kernel is not built for this source"):
        assert compiled.library("attention", "invariant attention", {"attend": ([], None)}) is None


@pytest.mark.parametrize("name", sorted(compiled.BUILDS))
def test_the_install_built_every_kernel_this_cpu_runs(name: str) -> None:
    """Where the CPU runs a kernel, the install (`make setup`: pip install -e .) has built it: a build that
    silently failed would otherwise only skip its tests. On an AVX2 CPU the GGUF weights load the AVX2 kernel."""
    if not compiled.cpu_supports(compiled.BUILDS[name].cpu):
        pytest.skip(f"{name} needs {sorted(compiled.BUILDS[name].cpu)}, which this CPU lacks")
    assert (compiled.KERNELS / f"{compiled.module(name)}{SUFFIX}").exists()
    loaded = {"int4_vnni": int4_vnni.library, "int8_avx2": int8_avx2.library, "attention": attention.library}
    if name in loaded:
        assert loaded[name]() is not None
    lib = kquant.library()
    assert lib is not None  # every CPU that runs one of the kernels runs the AVX2 GGUF kernel
    picked = next(kernel for kernel in kquant.KERNELS if compiled.cpu_supports(compiled.BUILDS[kernel].cpu))
    assert Path(lib._name).name.startswith(f"{picked}_")
