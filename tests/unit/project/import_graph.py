"""The import graph between our files, read from their source: cycles and rule-breaking edges.

Every import counts (module level, inside functions, under ``if TYPE_CHECKING:``).
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from pathlib import Path

Graph = dict[str, set[str]]


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Each module's dotted name (a package by its ``__init__.py``) and its file."""
    files: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if any(part.startswith(".") for part in parts):
                continue  # virtual environments and caches kept inside a package folder
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _named(name: str, modules: dict[str, Path]) -> str | None:
    """The longest of our modules that ``name`` lies in (``web.app.create_app`` -> ``web.app``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that ``module`` imports, wherever in the file the import sits."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(_named(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: ``from .x import y`` inside ``package``
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}".rstrip(".")
            # ``from pkg import sub`` imports the module ``pkg.sub`` when there is one.
            found.update(_named(f"{base}.{alias.name}", modules) for alias in node.names)
    return {name for name in found if name is not None and name != module}


def import_graph(root: Path, packages: Iterable[str], also: Iterable[str] = ()) -> Graph:
    """What each module of ``packages`` imports of them (and of the ``also`` packages)."""
    packages = tuple(packages)
    modules = module_files(root, (*packages, *also))
    return {
        name: imports_of(name, path, modules) for name, path in module_files(root, packages).items()
    }


def cycles(graph: Graph) -> list[list[str]]:
    """The modules caught in each import cycle (strongly connected groups of two or more)."""
    reach = {name: _reachable(graph, name) for name in graph}
    groups = {frozenset(n for n in reach[name] if name in reach.get(n, ())) for name in graph}
    return sorted(sorted(group) for group in groups if len(group) > 1)


def _reachable(graph: Graph, start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph.get(todo.pop(), set()) - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def forbidden(graph: Graph, allowed: Callable[[str, str], bool]) -> list[str]:
    """Every edge ``a imports b`` that ``allowed(a, b)`` refuses."""
    return [
        f"{a} imports {b}" for a in sorted(graph) for b in sorted(graph[a]) if not allowed(a, b)
    ]
