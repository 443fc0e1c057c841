"""The rooms of docs/architecture.md hold: every package of the tree is in its table, and every import of
specserve's own code goes only where its room's row allows (ray stays above the core, the CPU kernels are
reached only through the engine)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP = ("speculative", "actors", "deploy", "modelstore", "proto", "bench")
RAY_ROOMS = ("actors", "deploy", "bench")  # and their sub-rooms


def _rooms() -> dict[str, set[str] | None]:
    """room (dotted) -> the rooms it may import (None: anything), from the table of docs/architecture.md."""
    rooms: dict[str, set[str] | None] = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not re.fullmatch(r"`[\w/]+/`", cells[0]):
            continue
        room = cells[0].strip("`/").replace("/", ".")
        allowed = {m.strip("/").replace("/", ".") for m in re.findall(r"`([\w/]+/)`", cells[2])}
        rooms[room] = None if cells[2] == "anything" else allowed
    return rooms


ROOMS = _rooms()


def _room_of(module: str) -> str | None:
    """The longest room that `module` (dotted) lies in."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in ROOMS:
            return ".".join(parts[:n])
    return None


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _sources() -> list[Path]:
    return sorted(
        p for top in TOP for p in (ROOT / top).rglob("*.py") if "_pb2" not in p.name and "results" not in p.parts
    )


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in the file, at any depth (function-level, TYPE_CHECKING)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]  # `from pkg import module`
    return found


def test_the_table_names_every_package_of_the_tree() -> None:
    packages = {_module_of(p.parent / "__init__.py") for p in _sources() if (p.parent / "__init__.py").exists()}
    packages |= {"modelstore", "proto"}
    unnamed = sorted(p for p in packages if p not in ROOMS and not p.startswith("bench"))
    assert not unnamed, f"packages missing from docs/architecture.md's table: {unnamed}"
    assert not [r for r in ROOMS if not (ROOT / r.replace(".", "/")).is_dir()], "a room of the table has no folder"


def test_every_import_goes_where_its_room_allows() -> None:
    wrong = []
    for path in _sources():
        module = _module_of(path)
        room = _room_of(module)
        assert room is not None, f"{path} lies in no room of docs/architecture.md"
        allowed = ROOMS[room]
        for line, name in _imports(path):
            if name.split(".")[0] == "ray" and not module.startswith(RAY_ROOMS):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports ray (only {', '.join(RAY_ROOMS)} may)")
            if name.split(".")[0] not in TOP or allowed is None:
                continue
            target = _room_of(name)
            if target is None:  # `from pkg import name` where name is not a module
                continue
            if target != room and target not in allowed:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({room}) imports {name} ({target})")
    assert not wrong, "imports the rooms do not allow:\n" + "\n".join(sorted(set(wrong)))


@pytest.mark.parametrize(
    ("importer", "imported", "allowed"),
    [
        ("speculative.rules.verify", "speculative.drafters.base", False),  # rules import nothing above them
        ("actors.router", "deploy.config", False),  # nothing below deploy imports it
        ("actors.loading", "speculative.engine.cpu.onednn_linear", False),  # kernels only through the engine
        ("speculative.engine.loading", "speculative.engine.cpu.onednn_linear", True),
        ("deploy.app", "actors.router", True),
    ],
)
def test_the_rules_read_from_the_table_are_the_intended_ones(importer: str, imported: str, allowed: bool) -> None:
    """The table parses into the rules it states (a table the parser misreads would allow everything)."""
    room, target = _room_of(importer), _room_of(imported)
    rules = ROOMS[room] if room else None
    assert rules is not None
    assert (target == room or target in rules) is allowed


MAX_PARAMETERS = 6  # beyond it a function wants a row or a config type (issue 46)


def test_no_function_of_the_core_or_the_actors_takes_more_than_six_parameters() -> None:
    """`self` and `cls` aside, every positional, keyword-only and variadic parameter counts."""
    wide = []
    for path in _sources():
        if path.relative_to(ROOT).parts[0] not in ("speculative", "actors"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            a = node.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
            count = len(names) + (a.vararg is not None) + (a.kwarg is not None)
            if count > MAX_PARAMETERS:
                wide.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} takes {count}")
    assert not wide, "functions over the parameter limit:\n" + "\n".join(wide)
