"""LoRA adapters in SQL: register (for one tenant or all), list, remove (each audited), and the
adapters a tenant may call by name."""

from __future__ import annotations

from datetime import datetime

import msgspec
from sqlalchemy import or_, select
from sqlalchemy.exc import IntegrityError

from tenants.audit import add_entry
from tenants.database import Database
from tenants.errors import ConflictError, InvalidInputError, NotFoundError, TenantNotFoundError
from tenants.key_format import new_id
from tenants.models import LoraAdapterRow, Tenant
from tenants.timeutil import Clock, utc_now

MAX_NAME_CHARS = 128
MAX_PATH_CHARS = 4096
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-:/")


class LoraAdapterInfo(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    name: str
    path: str
    tenant_id: str | None  # None: every tenant may use it
    created_at: datetime
    created_by: str
    # The served model it rides on; None: the first served model (as before it could be named).
    base_model: str | None = None


def adapter_info(row: LoraAdapterRow) -> LoraAdapterInfo:
    return LoraAdapterInfo(
        id=row.id,
        name=row.name,
        path=row.path,
        tenant_id=row.tenant_id,
        created_at=row.created_at,
        created_by=row.created_by,
        base_model=row.base_model,
    )


def check_name(name: str) -> str:
    """A name requests can carry in ``model``: 1-128 of letters, digits and ``._-:/``."""
    if not 0 < len(name) <= MAX_NAME_CHARS or not set(name) <= _NAME_CHARS:
        raise InvalidInputError(
            f"name must be 1 to {MAX_NAME_CHARS} letters, digits or . _ - : /", "name"
        )
    return name


def check_base_model(base_model: str | None) -> str | None:
    """A served model's name (1-128 characters, none of them a control character), or None."""
    if base_model is not None and (
        not 0 < len(base_model) <= MAX_NAME_CHARS or not base_model.isprintable()
    ):
        raise InvalidInputError(
            f"base_model must be a served model's name of 1 to {MAX_NAME_CHARS} characters",
            "base_model",
        )
    return base_model


def check_path(path: str) -> str:
    if not path.strip() or len(path) > MAX_PATH_CHARS or "\x00" in path:
        raise InvalidInputError(f"path must be 1 to {MAX_PATH_CHARS} characters, no NUL", "path")
    return path


class LoraAdapterService:
    def __init__(self, db: Database, clock: Clock = utc_now) -> None:
        self._db = db
        self._clock = clock

    async def register(
        self,
        name: str,
        path: str,
        tenant_id: str | None,
        *,
        base_model: str | None = None,
        actor: str = "admin",
    ) -> LoraAdapterInfo:
        """Store a new adapter on ``base_model`` (None: the first served model); ConflictError
        when the name is taken, TenantNotFoundError for an unknown (or deleted) tenant. Whether
        a server serves ``base_model`` is its own to check: another may serve it."""
        check_name(name)
        check_path(path)
        check_base_model(base_model)
        now = self._clock()
        try:
            async with self._db.transaction() as session:
                if tenant_id is not None:
                    # No stored id holds NUL (PostgreSQL text cannot), so such a one is unknown.
                    known = "\x00" not in tenant_id
                    tenant = await session.get(Tenant, tenant_id) if known else None
                    if tenant is None or tenant.status == "deleted":
                        raise TenantNotFoundError(f"no tenant {tenant_id!r}")
                taken = await session.scalar(
                    select(LoraAdapterRow.id).where(LoraAdapterRow.name == name)
                )
                if taken is not None:
                    raise ConflictError(f"an adapter named {name!r} already exists")
                row = LoraAdapterRow(
                    id=new_id("la"),
                    name=name,
                    path=path,
                    tenant_id=tenant_id,
                    created_at=now,
                    created_by=actor,
                    base_model=base_model,
                )
                session.add(row)
                await session.flush()
                info = adapter_info(row)
                add_entry(
                    session,
                    at=now,
                    actor=actor,
                    action="lora_adapter.register",
                    target=row.id,
                    before=None,
                    after=info,
                )
        except IntegrityError as exc:  # a concurrent registration of the same name
            raise ConflictError(f"an adapter named {name!r} already exists") from exc
        return info

    async def list_adapters(self, tenant_id: str | None = None) -> list[LoraAdapterInfo]:
        """Every adapter (by name), or those ``tenant_id`` may use: its own and the shared."""
        stmt = select(LoraAdapterRow).order_by(LoraAdapterRow.name)
        if tenant_id is not None:
            stmt = stmt.where(
                or_(LoraAdapterRow.tenant_id == tenant_id, LoraAdapterRow.tenant_id.is_(None))
            )
        async with self._db.sessions() as session:
            return [adapter_info(row) for row in await session.scalars(stmt)]

    async def usable(self, tenant_id: str, name: str) -> LoraAdapterInfo | None:
        """The adapter ``name`` if ``tenant_id`` may use it, else None (another tenant's adapter
        is as absent as an unknown one)."""
        if not 0 < len(name) <= MAX_NAME_CHARS:
            return None
        async with self._db.sessions() as session:
            row = await session.scalar(
                select(LoraAdapterRow).where(
                    LoraAdapterRow.name == name,
                    or_(LoraAdapterRow.tenant_id == tenant_id, LoraAdapterRow.tenant_id.is_(None)),
                )
            )
            return None if row is None else adapter_info(row)

    async def remove(self, adapter_id: str, *, actor: str = "admin") -> LoraAdapterInfo:
        """Delete an adapter; NotFoundError for an unknown id. Requests already running keep
        it until they finish."""
        now = self._clock()
        async with self._db.transaction() as session:
            row = await session.get(LoraAdapterRow, adapter_id[:64])
            if row is None:
                raise NotFoundError(f"no adapter {adapter_id[:64]!r}")
            info = adapter_info(row)
            await session.delete(row)
            add_entry(
                session,
                at=now,
                actor=actor,
                action="lora_adapter.remove",
                target=info.id,
                before=info,
                after=None,
            )
        return info
