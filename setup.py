"""The build's two steps beyond pyproject.toml: the gRPC stubs of proto/specserve.proto, generated into the package,
and our C kernels, compiled into it.

The stubs are not in git (`make proto` writes them into an editable checkout): a wheel gets them from its build,
which runs grpcio-tools' protoc (a build requirement, pyproject.toml's [build-system]) into the build directory,
so `pip install .` and a wheel built anywhere import `proto.specserve_pb2_grpc` with no grpcio-tools at run time.
The generated code checks at import that the installed grpcio and protobuf are at least the versions that
generated it: pyproject.toml pins the build's grpcio-tools to the floors of its runtime `dependencies`.

The kernels (speculative/engine/cpu/kernels/*.c, loaded with ctypes) are optional extensions named and flagged by
speculative/engine/cpu/compiled.py: `pip install .` builds them into the wheel, `pip install -e .` beside their
sources; a missing compiler or a failed build leaves one out with a warning, and the package runs torch's path.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO = "proto/specserve.proto"


def generate_stubs(out: Path) -> None:
    """protoc of PROTO into `out` (specserve_pb2.py, .pyi, specserve_pb2_grpc.py under out/proto/), as `make proto`."""
    import importlib.resources

    from grpc_tools import protoc

    well_known = importlib.resources.files("grpc_tools") / "_proto"  # google/protobuf/struct.proto
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        str(ROOT / PROTO),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"grpc_tools.protoc failed on {PROTO}")


class BuildWithStubs(build_py):
    """build_py, then the stubs into the built package (not for an editable install: `make proto` serves those)."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            generate_stubs(Path(self.build_lib))


def kernels() -> list[Extension]:
    """Every kernel of compiled.BUILDS as an optional extension (compiled.py read by its path: nothing is installed
    yet, and the package's __init__ files import torch)."""
    spec = importlib.util.spec_from_file_location("specserve_compiled", ROOT / "speculative/engine/cpu/compiled.py")
    assert spec is not None and spec.loader is not None
    compiled = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = compiled  # NamedTuple looks its module up
    spec.loader.exec_module(compiled)
    return [
        Extension(
            f"{compiled.PACKAGE}.{compiled.module(name)}",
            [f"speculative/engine/cpu/kernels/{name}.c"],
            extra_compile_args=compiled.compile_args(name),
            extra_link_args=list(build.link),
            depends=[f"speculative/engine/cpu/kernels/{header}" for header in build.headers],
            optional=True,
        )
        for name, build in compiled.BUILDS.items()
    ]


setup(cmdclass={"build_py": BuildWithStubs}, ext_modules=kernels())
