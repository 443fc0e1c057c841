"""The lock (constraints.txt): this install is the lock's, the lock is what pyproject.toml declares, every install
takes it, and the served packages import only what they declare.

CI installs a fresh clone with `make setup` (`pip install -c constraints.txt ...`), then runs this file: every
locked distribution must be installed at its locked version (pip's freeze, compared), and the closure of the
declared requirements through the installed distributions' own must be exactly the lock (a stale lock, or one
missing what a dependency needs, fails). Distributions installed beside ours are not looked at.
"""

from __future__ import annotations

import ast
import itertools
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from deploy import lock

ROOT = lock.REPO
SERVED = ("speculative", "actors", "deploy", "modelstore", "proto")  # what the package serves with
DEV = ("bench", "tests")  # their imports may also come from [dev]


def test_every_locked_distribution_is_installed_at_its_locked_version() -> None:
    locked = lock.read(lock.LOCK.read_text())
    assert locked["torch"] == "2.13.0" and len(locked) > 50
    assert lock.differences(lock.closure(lock.declared()), locked) == []
    assert lock.check() == []
    assert lock.main(["check"]) == 0


def test_the_lock_is_the_closure_of_the_declared_requirements() -> None:
    """What `make lock` would write: no distribution missing, none left over, the same text."""
    pins = lock.closure(lock.declared())
    assert pins == lock.read(lock.LOCK.read_text())
    assert lock.render(pins) == lock.LOCK.read_text(), "constraints.txt is stale: run `make lock`"
    assert {"ray", "fastapi", "starlette", "uvicorn"} <= pins.keys()  # ray[serve]'s extra was followed


def test_a_drifted_or_stale_lock_is_reported(tmp_path: Path) -> None:
    locked = lock.read(lock.LOCK.read_text())
    drifted = dict(locked, numpy="1.0.0")
    del drifted["pyyaml"]
    drifted["left-over"] = "1.0"
    (tmp_path / "lock.txt").write_text(lock.render(drifted))
    problems = lock.check(lock=tmp_path / "lock.txt")
    assert [p.split(":")[0] for p in problems] == ["numpy", "pyyaml", "left-over"], problems
    subset = lock.check(extras=[], lock=tmp_path / "lock.txt")  # an image's: the locked names, their versions
    assert [p.split(":")[0] for p in subset] == ["numpy"], subset


def test_a_requirement_the_installed_version_breaks_is_an_error() -> None:
    requirements = [*lock.declared(), Requirement("numpy<1")]
    try:
        lock.closure(requirements)
    except ValueError as error:
        assert "numpy<1" in str(error)
    else:
        raise AssertionError("numpy<1 passed")


def make_rule(target: str) -> list[str]:
    """The Makefile's rule `target`: its line of prerequisites (without the ## help), then its recipe lines."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    recipe = itertools.takewhile(lambda line: line.startswith("\t"), lines[start + 1 :])
    return [lines[start].split("##")[0], *(line.strip() for line in recipe)]


def make_variable(name: str) -> str:
    (value,) = re.findall(rf"^{name} :?= (.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    return value.strip()


def test_every_install_takes_the_lock_and_make_run_only_what_serving_needs() -> None:
    assert make_variable("LOCK") == lock.LOCK.name
    assert make_variable("TORCH") == f"torch=={lock.read(lock.LOCK.read_text())['torch']}"
    for target in ("setup", "setup-serve"):
        (install,) = [line for line in make_rule(target) if " install " in line]
        assert '-c $(LOCK) "$(TORCH)"' in install, target
    assert '".[dev]"' in make_rule("setup")[1] and "[dev]" not in " ".join(make_rule("setup-serve"))
    assert make_rule("run")[0].split() == ["run:", "serve-models"]
    assert make_rule("serve-models")[0].split() == ["serve-models:", "setup-serve"]
    assert make_rule("test")[0].split()[1] == "models"

    local = yaml.safe_load((ROOT / "deploy" / "local.yaml").read_text())
    (app,) = local["applications"]
    assert make_variable("SERVED_MODELS").split() == [app["args"]["target_model"], app["args"]["draft_model"]]


def third_party_imports(path: Path) -> set[str]:
    """Top-level modules `path` imports outside the standard library and this repository, at any depth, except
    imports inside a `try` that catches ImportError (optional: the code runs without them)."""
    tree = ast.parse(path.read_text(), str(path))
    optional: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError") for h in node.handlers
        ):
            optional |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    ours = {*SERVED, *DEV, "__future__"}
    return {m for m in found if m not in sys.stdlib_module_names and m not in ours}


def declared_names(extras: list[str]) -> set[str]:
    return {canonicalize_name(r.name) for r in lock.declared(extras)}


def test_the_served_packages_import_only_what_they_declare() -> None:
    """Every third-party import of the served packages is a distribution of pyproject.toml's `dependencies`
    (not merely something a dependency brings); bench/ and tests/ may also import [dev]'s."""
    providers = packages_distributions()
    runtime, dev = declared_names([]), declared_names(["dev"])
    undeclared = []
    for top in (*SERVED, *DEV):
        allowed = runtime if top in SERVED else dev
        for path in sorted((ROOT / top).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            for module in third_party_imports(path):
                dists = {canonicalize_name(d) for d in providers.get(module, [module])}
                if not dists & allowed:
                    undeclared.append(f"{path.relative_to(ROOT)}: {module} ({', '.join(sorted(dists))})")
    assert not undeclared, "imported but not declared in pyproject.toml:\n" + "\n".join(undeclared)
