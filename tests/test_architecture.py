"""The package's layering, checked from its source (the `ast` of every module of host/rudder):

- the import graph of rudder's modules has no cycle (imports inside functions count: a lazy
  import is still a dependency, only a hidden one);
- no module imports another's private names (`from .x import _y`, `x._y` on an imported module);
- no module reaches into a private attribute or method that another module defines
  (`engine._append(...)` from the speculator was how Branch semantics leaked out of one place).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "host" / "rudder"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
TREES = {name: ast.parse(path.read_text(encoding="utf-8"), str(path)) for name, path in MODULES.items()}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(module: str, level: int, target: str | None) -> str:
    """The absolute name of `from <level dots><target> import ...` inside `module`."""
    if level == 0:
        return target or ""
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _imports(name: str) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import of `name`, at any depth."""
    out = []
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            out.extend((alias.name, [], node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, node.level, node.module)
            out.append((base, [a.name for a in node.names], node.lineno))
    return out


def _edges(name: str) -> set[str]:
    edges = set()
    for base, names, _ in _imports(name):
        for taken in names or [""]:
            sub = f"{base}.{taken}" if taken else base
            if sub in MODULES:
                edges.add(sub)  # `from . import native`: the submodule itself
            elif base in MODULES:
                edges.add(base)
    edges.discard(name)
    return edges


def test_the_import_graph_has_no_cycle():
    graph = {name: _edges(name) for name in MODULES}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_imports_private_names():
    found = []
    for name in MODULES:
        aliases = {}  # local name -> rudder module imported as a whole
        for base, names, line in _imports(name):
            for taken in names:
                if _private(taken) and (base in MODULES or f"{base}.{taken}" not in MODULES):
                    if base.startswith("rudder"):
                        found.append(f"{name}:{line}: from {base} import {taken}")
                if f"{base}.{taken}" in MODULES:
                    aliases[taken] = f"{base}.{taken}"
        for node in ast.walk(TREES[name]):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in MODULES:
                        aliases[(alias.asname or alias.name).split(".")[0]] = alias.name
        for node in ast.walk(TREES[name]):
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases):
                found.append(f"{name}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not found, "\n".join(found)


def _defined_privates(name: str) -> set[str]:
    """Private methods and attributes a module defines on its own objects (def _x, self._x = ...)."""
    out = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
            out.add(node.name)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            out.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and _private(stmt.target.id):
                    out.add(stmt.target.id)
    return out


def test_no_module_reaches_into_another_modules_privates():
    owners: dict[str, set[str]] = {}
    for name in MODULES:
        for attr in _defined_privates(name):
            owners.setdefault(attr, set()).add(name)
    found = []
    for name in MODULES:
        mine = _defined_privates(name)
        for node in ast.walk(TREES[name]):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in owners and node.attr not in mine:
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)} (defined in {sorted(owners[node.attr])})")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("source", ["from .x import _y", "import rudder.engine as e\ne._f()"])
def test_the_checks_see_what_they_look_for(source, monkeypatch):
    """The private-import check finds a planted violation (so a green run means something)."""
    monkeypatch.setitem(TREES, "rudder.engine.llm_engine", ast.parse(source))
    with pytest.raises(AssertionError):
        test_no_module_imports_private_names()


def test_the_cycle_check_sees_a_planted_cycle(monkeypatch):
    monkeypatch.setitem(TREES, "rudder.branch", ast.parse("from .engine import llm_engine"))
    with pytest.raises(AssertionError, match="import cycles"):
        test_the_import_graph_has_no_cycle()
