"""`atrium db check` on a schema newer than the code: a later release's expand migration (one
revision past this code's head) is accepted and said so; a contract migration that drops what
this code needs, or a revision of no known lineage, is refused. SQLite and PostgreSQL.

"Newer" is decided by the database: each migration records the oldest code revision that runs
on the schema it leaves (``compatible_from``, by default the revision before it), and this code
runs when it ships that revision (see ``tenants/schema_version.py``)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, delete, text

from tenants import Database
from tenants.database import script_location
from tenants.errors import MigrationError
from tenants.models import Setting
from tenants.schema_version import MARKER_KEY, SchemaState, upgrade_unless_newer
from tests.integration.pg_gateway import migrated_database
from tests.support.postgres import migrate, pg_url
from web.cli import main
from web.cli.db_commands import head_revision
from web.cli.serve import schema_problem
from web.settings import Settings

REVISION = '''"""{doc}

Revision ID: {rev}
Revises: {down}
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "{rev}"
down_revision = "{down}"
branch_labels = None
depends_on = None
{compat}

def upgrade() -> None:
    {upgrade}


def downgrade() -> None:
    pass
'''


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'atrium.db'}"
        asyncio.run(migrate(url))
        yield url
        return
    with migrated_database() as name:
        yield pg_url(name)


def later_release(folder: Path, revision: str, down: str, upgrade: str, compat: str = "") -> Path:
    """A copy of this code's migrations with one more revision, as the next release ships."""
    if not folder.exists():
        shutil.copytree(script_location(), folder, ignore=shutil.ignore_patterns("__pycache__"))
    script = REVISION.format(
        doc=f"a later release's {revision}", rev=revision, down=down, upgrade=upgrade, compat=compat
    )
    (folder / "versions" / f"{revision}_later.py").write_text(script)
    return folder


async def upgrade_with(url: str, folder: Path) -> None:
    """Migrate ``url`` with the migrations in ``folder`` (a later release's `atrium db upgrade`)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(folder))

    def run(sync: Connection) -> None:
        cfg.attributes["connection"] = sync
        command.upgrade(cfg, "head")

    db = await Database.connect(url)
    try:
        async with db.engine.begin() as conn:
            await conn.run_sync(run)
    finally:
        await db.close()


async def forget_lineage(url: str) -> None:
    """A revision id stamped by hand, with no compatibility record."""
    db = await Database.connect(url)
    try:
        async with db.engine.begin() as conn:
            await conn.execute(text("UPDATE alembic_version SET version_num = 'feedbeef'"))
            await conn.execute(delete(Setting).where(Setting.key == MARKER_KEY))
    finally:
        await db.close()


def db_check(url: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = main(["db", "check", "--database-url", url])
    out, err = capsys.readouterr()
    return status, out, err


def serve_problem(url: str) -> str | None:
    return schema_problem(Settings.load({"database_url": url}, environ={}))


async def start_migration(url: str) -> SchemaState:
    """What a gateway on the embedded database does at start (it migrates SQLite itself)."""
    db = await Database.connect(url)
    try:
        return await upgrade_unless_newer(db)
    finally:
        await db.close()


def test_db_check_accepts_a_newer_compatible_schema_and_refuses_the_rest(
    database_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    head = head_revision()
    assert head is not None
    status, out, _ = db_check(database_url, capsys)
    assert (status, out.strip()) == (0, head)
    # The next release adds a table (expand): this code still runs on it.
    nxt = f"{int(head) + 1:04d}"
    folder = later_release(
        tmp_path / "later",
        nxt,
        head,
        'op.create_table("later_things", sa.Column("id", sa.Integer(), primary_key=True))',
    )
    asyncio.run(upgrade_with(database_url, folder))
    status, out, err = db_check(database_url, capsys)
    assert status == 0, err
    assert out.strip() == f"{nxt} (newer than this code's {head}; code from {head} on runs on it)"
    if not database_url.startswith("sqlite"):  # serve applies the same rule
        assert serve_problem(database_url) is None
    else:  # and a gateway on SQLite starts on it, leaving it as it is
        assert asyncio.run(start_migration(database_url))[:2] == ("newer", nxt)
    # A rollback's migration Job runs this code's `db upgrade`: nothing to do, and it says so.
    assert main(["db", "upgrade", "--database-url", database_url]) == 0
    assert capsys.readouterr().out == out
    # The release after drops what this code reads (contract): refused, and said why.
    after = f"{int(head) + 2:04d}"
    later_release(
        folder, after, nxt, 'op.drop_table("later_things")', compat=f'compatible_from = "{nxt}"'
    )
    asyncio.run(upgrade_with(database_url, folder))
    status, out, err = db_check(database_url, capsys)
    assert (status, out) == (1, "")
    assert f"at {after}, newer than this code ({head}) runs on: it needs code from {nxt} on" in err
    if not database_url.startswith("sqlite"):
        problem = serve_problem(database_url)
        assert problem is not None and f"revision {after}" in problem
    else:
        with pytest.raises(MigrationError, match=f"at revision {after}, which this version"):
            asyncio.run(start_migration(database_url))
    assert main(["db", "upgrade", "--database-url", database_url]) != 0
    assert f"at revision {after}, which this version ({head}) cannot run on" in (
        capsys.readouterr().err
    )
    # A revision id nobody's migrations recorded: of no lineage this code knows.
    asyncio.run(forget_lineage(database_url))
    status, out, err = db_check(database_url, capsys)
    assert (status, out) == (1, "")
    assert "at feedbeef, a revision of no lineage this code" in err
