"""Guards on the repository shape: import directions (DESIGN.md §1), no Python in platform/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("atrium_errors", "radix_cache", "engine", "tenants", "web", "migrations", "bench")
# The leaf every package may import: the one error base (it imports nothing of ours).
LEAF = {"atrium_errors"}
# Which of our packages each package may import (DESIGN.md §1). Never back up.
ALLOWED: dict[str, set[str]] = {
    "atrium_errors": set(),
    "radix_cache": LEAF,
    "tenants": LEAF,
    "engine": {"radix_cache"} | LEAF,
    "migrations": {"tenants"} | LEAF,
    "web": {"engine", "radix_cache", "tenants", "migrations"} | LEAF,
    "bench": {"engine", "radix_cache", "tenants", "web", "migrations"} | LEAF,
}


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_follow_the_allowed_directions(package: str) -> None:
    violations = []
    for path in sorted((ROOT / package).rglob("*.py")):
        if any(part.startswith(".") for part in path.relative_to(ROOT).parts):
            continue  # virtual environments and caches kept inside a package folder
        for imported in _imported_packages(path) - ALLOWED[package] - {package}:
            violations.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert violations == []


def test_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import web.cli\nfrom engine.errors import EngineError\nimport os\n")
    assert _imported_packages(bad) == {"web", "engine"}


def test_platform_holds_no_python() -> None:
    # A package named `platform` would shadow the standard library module of that name.
    python_files = [p for p in (ROOT / "platform").rglob("*") if p.suffix in {".py", ".pyc"}]
    assert python_files == []
    assert not (ROOT / "platform" / "__init__.py").exists()


def _imports_torch(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(
            alias.name.split(".")[0] == "torch" for alias in node.names
        ):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            return True
    return False


def test_web_imports_no_torch() -> None:
    # Building an engine (model, dtype, device, threads) is engine/'s job (engine/factory.py).
    found = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "web").rglob("*.py"))
        if not any(part.startswith(".") for part in path.relative_to(ROOT).parts)
        and _imports_torch(path)
    ]
    assert found == []


def test_torch_checker_sees_a_torch_import_anywhere(tmp_path: Path) -> None:
    nested = tmp_path / "nested.py"
    nested.write_text("def f():\n    from torch.nn import functional\n")
    plain = tmp_path / "plain.py"
    plain.write_text("import os, torch.cuda\n")
    clean = tmp_path / "clean.py"
    clean.write_text("torch_threads = 1\nimport engine.factory\n")
    assert [_imports_torch(p) for p in (nested, plain, clean)] == [True, True, False]
