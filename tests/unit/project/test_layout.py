"""Guards on the repository shape: no import cycle between files, imports in the allowed
directions between packages and between web/'s faces (DESIGN.md §1), no Python in platform/."""

from __future__ import annotations

from pathlib import Path

from tests.unit.project.import_graph import Graph, cycles, forbidden, import_graph, module_files

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("radix_cache", "engine", "tenants", "web", "migrations", "bench")
# Which of our packages each package may import (DESIGN.md §1). Never back up.
ALLOWED: dict[str, set[str]] = {
    "radix_cache": set(),
    "tenants": set(),
    "engine": {"radix_cache"},
    "migrations": {"tenants"},
    "web": {"engine", "radix_cache", "tenants"},
    "bench": {"engine", "radix_cache", "tenants", "web", "migrations"},
}
# web/'s faces from the bottom up: a face imports its own level and the ones below. Only the CLI
# imports the app factory; a face missing here is refused until it is given its level.
WEB_LEVELS = {
    "ops": 0,
    "tenancy": 1,
    "openai": 2,
    "admin": 2,
    "console": 2,
    "engine_api": 2,
    "app": 3,
    "cli": 4,
}
ANYONE_MAY_IMPORT = {"web", "web.settings"}


def allowed(importer: str, imported: str) -> bool:
    """Whether module ``importer`` may import module ``imported``."""
    package, target = importer.partition(".")[0], imported.partition(".")[0]
    if package != target:
        return target in ALLOWED.get(package, set())
    if package != "web" or imported in ANYONE_MAY_IMPORT:
        return True
    level, target_level = (WEB_LEVELS.get(name.split(".")[1]) for name in (importer, imported))
    return level is not None and target_level is not None and target_level <= level


def _graph(root: Path) -> Graph:
    return import_graph(root, PACKAGES, also=("tests",))


def test_no_import_cycle_between_files() -> None:
    files = module_files(ROOT, PACKAGES)
    found = [[str(files[m].relative_to(ROOT)) for m in cycle] for cycle in cycles(_graph(ROOT))]
    assert found == []


def test_imports_follow_the_allowed_directions() -> None:
    assert forbidden(_graph(ROOT), allowed) == []


def test_the_checker_reports_a_planted_cycle_and_a_backward_import(tmp_path: Path) -> None:
    planted = {
        # a cycle through a function-level and a type-only import
        "web/tenancy/principal.py": "def connect():\n    from web.tenancy.sql import open_db\n",
        "web/tenancy/sql.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from web.tenancy.principal import Principal\n"
        ),
        "web/ops/health.py": "from web.tenancy import principal\nfrom web import settings\n",
        "web/openai/routes.py": "import web.tenancy.sql\nimport web.app\n",
        "web/cli/serve.py": "from web.app import create_app\nfrom web.openai.routes import x\n",
        "engine/request.py": "import os\nfrom web.openai import routes\n",
        "bench/run.py": "from tests.support.serve import Server\nimport engine.request\n",
    }
    for name in ("web", "web/tenancy", "web/ops", "web/openai", "web/cli", "engine", "bench"):
        (tmp_path / name).mkdir(parents=True, exist_ok=True)
        (tmp_path / name / "__init__.py").write_text("")
    for name in ("web/app.py", "web/settings.py", "tests/support/serve.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    for name, text in planted.items():
        (tmp_path / name).write_text(text)
    graph = _graph(tmp_path)
    assert cycles(graph) == [["web.tenancy.principal", "web.tenancy.sql"]]
    assert forbidden(graph, allowed) == [
        "bench.run imports tests.support.serve",
        "engine.request imports web.openai.routes",
        "web.openai.routes imports web.app",
        "web.ops.health imports web.tenancy.principal",
    ]


def test_platform_holds_no_python() -> None:
    # A package named `platform` would shadow the standard library module of that name.
    python_files = [p for p in (ROOT / "platform").rglob("*") if p.suffix in {".py", ".pyc"}]
    assert python_files == []
    assert not (ROOT / "platform" / "__init__.py").exists()
