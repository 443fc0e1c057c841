"""constraints.txt, the lock: every distribution specserve and its extras need, at the version installed here.

    python -m deploy.lock write                 # (make lock) from this environment, once the suite passes in it
    python -m deploy.lock check                 # exit 1 when this install differs from the lock (CI's test_lock.py)
    python -m deploy.lock check --extras gpu    # the package and the named extras only, locked names (the image)

The lock is the closure of pyproject.toml's `dependencies` and every extra: each requirement is followed
through the installed distributions' own requirements, with their markers evaluated here (CPython 3.11,
Linux x86-64, as CI) and the extras asked for (`ray[serve]`). `make setup`, `make setup-serve` and the image
install with `pip install -c constraints.txt ...`: pip then takes exactly these versions of whatever it installs.
A local version label is dropped (torch 2.13.0+cpu is locked as 2.13.0): the index, not the lock, picks the
build, so the CPU wheel and the CUDA build share one lock. A CUDA build's own requirements (nvidia-*, triton)
are absent from the lock: that wheel pins each of them exactly itself.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "constraints.txt"
PYPROJECT = REPO / "pyproject.toml"
HEADER = """\
# The lock: the exact version of every distribution specserve, its [dev] and its [gpu] extras need, installed as
# constraints (`pip install -c constraints.txt ...`: make setup, make setup-serve, the Dockerfile).
# Written by `make lock` (python -m deploy.lock write) from an environment the suite passed in: pyproject.toml's
# dependencies and extras, followed through the installed distributions' requirements (markers as on CPython
# 3.11, Linux x86-64). Local labels are dropped (torch 2.13.0+cpu -> 2.13.0): the index picks the build.
# tests/unit/test_lock.py fails when an installed version differs from this, or when this file is stale.
"""


def declared(extras: Iterable[str] | None = None, pyproject: Path = PYPROJECT) -> list[Requirement]:
    """pyproject.toml's `dependencies` and the requirements of `extras` (None: every extra)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    chosen = optional if extras is None else {name: optional[name] for name in extras}
    return [Requirement(line) for line in [*project["dependencies"], *(r for extra in chosen.values() for r in extra)]]


def closure(roots: Iterable[Requirement]) -> dict[str, str]:
    """name -> installed public version of every distribution `roots` need, through their requirements here.

    ValueError naming each problem: a needed distribution not installed, or installed at a version its
    requirement excludes (the lock would pin a version the resolver cannot take)."""
    pins: dict[str, str] = {}
    asked: dict[str, set[str]] = {}  # name -> the extras followed so far ("" for its plain requirements)
    problems: list[str] = []
    todo = list(roots)
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            problems.append(f"{requirement}: not installed")
            continue
        version = Version(dist.version)
        if not requirement.specifier.contains(version, prereleases=True):
            problems.append(f"{requirement}: {name} {version} is installed")
        pins[name] = version.public
        extras = {""} | {canonicalize_name(e) for e in requirement.extras}
        new = extras - asked.setdefault(name, set())
        asked[name] |= new
        for line in dist.requires or []:
            needed = Requirement(line)
            if any(needed.marker is None or needed.marker.evaluate({"extra": extra}) for extra in new):
                todo.append(needed)
    if problems:
        raise ValueError("the installed distributions miss the declared requirements:\n  " + "\n  ".join(problems))
    return dict(sorted(pins.items()))


def render(pins: dict[str, str]) -> str:
    """The lock file's text: the header, then `name==version` a line, by name."""
    return HEADER + "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()))


def read(text: str) -> dict[str, str]:
    """name -> version of a lock file's `name==version` lines (comments and blank lines skipped)."""
    pins: dict[str, str] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            specs = list(requirement.specifier)
            if len(specs) != 1 or specs[0].operator != "==":
                raise ValueError(f"{line!r}: a lock line is name==version")
            pins[canonicalize_name(requirement.name)] = specs[0].version
    return pins


def differences(needed: dict[str, str], locked: dict[str, str]) -> list[str]:
    """Each distribution `needed` (its installed public version) that the lock lacks or pins otherwise."""
    return [
        f"{name}: {version} is installed, " + (f"the lock has {locked[name]}" if name in locked else "not in the lock")
        for name, version in needed.items()
        if name not in locked or Version(locked[name]) != Version(version)
    ]


def check(extras: Iterable[str] | None = None, lock: Path = LOCK) -> list[str]:
    """What keeps this install from being the lock's: `differences` over the closure of the package and `extras`.

    None (every extra: CI's full install) also reports each locked name nothing needs (left by a removed
    requirement). Named extras (an image's install) compare the locked names only: a CUDA build of torch needs
    distributions the lock does not hold (nvidia-*, triton), which that wheel pins itself."""
    try:
        needed = closure(declared(extras))
    except ValueError as error:
        return [str(error)]
    locked = read(lock.read_text())
    if extras is not None:
        return differences({name: v for name, v in needed.items() if name in locked}, locked)
    stale = [f"{name}: locked, but nothing declared needs it" for name in locked if name not in needed]
    return differences(needed, locked) + stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.lock", description="Write or check constraints.txt.")
    parser.add_argument("action", choices=["write", "check"])
    parser.add_argument("--extras", help="check: the package and these extras (comma-separated; '' none), not all")
    args = parser.parse_args(argv)
    if args.action == "write":
        pins = closure(declared())
        LOCK.write_text(render(pins))
        print(f"{LOCK.relative_to(REPO)}: {len(pins)} distributions")
        return 0
    extras = None if args.extras is None else [e for e in args.extras.split(",") if e]
    problems = check(extras)
    for line in problems:
        print(line)
    if problems:
        print(f"install with `pip install -c {LOCK.name} ...`, or after a dependency change run `make lock`")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
