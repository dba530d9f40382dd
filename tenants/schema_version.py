"""Which schemas this code runs against: its own head, or a newer one whose migrations say this
code still runs on it. Migrations expand first and contract a release later, so a rollback to the
previous release finds a schema it can use; the database records how far back that reaches."""

from __future__ import annotations

from typing import Literal, NamedTuple

from alembic.script import Script, ScriptDirectory
from sqlalchemy import Connection, Table, delete, insert, select

from tenants.database import Database, script_location
from tenants.errors import MigrationError
from tenants.models import Setting

# The settings row naming the oldest code revision that runs on the schema as it stands.
MARKER_KEY = "schema_compatible_from"
_settings: Table = Setting.__table__  # type: ignore[assignment]

Kind = Literal["head", "newer", "older", "empty", "too_new", "unknown"]


class SchemaState(NamedTuple):
    """Where a database's schema stands for this code (``ok``: the code may run on it)."""

    kind: Kind
    revision: str | None  # the database's
    head: str | None  # this code's
    compatible_from: str | None  # the oldest code revision the database says runs on it

    @property
    def ok(self) -> bool:
        return self.kind in ("head", "newer")


def compatible_from(script: Script) -> str:
    """The oldest code revision that runs on the schema ``script`` leaves: what the revision
    declares as ``compatible_from`` (a contract step drops what older code reads), else the
    revision before it (an expand step: the previous code still runs)."""
    declared = getattr(script.module, "compatible_from", None)
    if isinstance(declared, str) and declared:
        return declared
    down = script.down_revision
    return down if isinstance(down, str) else script.revision


def record_compatibility(
    connection: Connection, scripts: ScriptDirectory, revision: str | None
) -> None:
    """Store ``compatible_from`` of ``revision``, the schema just migrated to (Alembic's env
    calls this in the migration's transaction)."""
    if revision is None:  # back to nothing: the settings table is gone too
        return
    value = compatible_from(scripts.get_revision(revision))
    connection.execute(delete(_settings).where(_settings.c.key == MARKER_KEY))
    connection.execute(insert(_settings).values(key=MARKER_KEY, value=value))


def classify(
    revision: str | None, marker: str | None, head: str | None, known: set[str]
) -> SchemaState:
    """The rule: this code's head runs; a revision this code ships but not its head is older; a
    revision it does not know is newer, and runs when the database names a compatible-from
    revision this code ships (so this code is at least that new). Without that record the
    schema is of no lineage this code knows."""
    if revision is None:
        kind: Kind = "empty"
    elif revision == head:
        kind = "head"
    elif revision in known:
        kind = "older"
    elif marker is None:
        kind = "unknown"
    else:
        kind = "newer" if marker in known else "too_new"
    return SchemaState(kind, revision, head, marker)


def code_revisions() -> tuple[str | None, set[str]]:
    """This code's head and every revision it ships."""
    scripts = ScriptDirectory(str(script_location()))
    return scripts.get_current_head(), {s.revision for s in scripts.walk_revisions()}


async def schema_state(db: Database) -> SchemaState:
    """Where ``db``'s schema stands for this code."""
    revision = await db.current()
    marker = None
    if revision is not None:
        async with db.sessions() as session:
            marker = await session.scalar(select(Setting.value).where(Setting.key == MARKER_KEY))
    head, known = code_revisions()
    return classify(revision, marker, head, known)


async def upgrade_unless_newer(db: Database) -> SchemaState:
    """Bring the database to this code's head, unless a later release migrated it to a schema
    this code runs on (then left as it is: a rollback starts, and its `db upgrade` changes
    nothing); a schema this code cannot run on raises MigrationError."""
    state = await schema_state(db)
    if state.kind in ("empty", "older"):
        await db.upgrade()
        return await schema_state(db)
    if not state.ok:
        raise MigrationError(
            f"the database is at revision {state.revision}, which this version ({state.head}) "
            "cannot run on; run the release that migrated it"
        )
    return state
