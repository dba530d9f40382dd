"""Tenant CRUD for the admin API and CLI; every mutation is audited in the same transaction."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from msgspec import UNSET
from sqlalchemy import bindparam, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.audit import add_entry
from tenants.database import Database
from tenants.errors import ConflictError, TenantNotFoundError
from tenants.key_format import new_id
from tenants.models import ApiKey, Tenant
from tenants.schemas import (
    Quotas,
    TenantCreate,
    TenantInfo,
    TenantPatch,
    TenantStatus,
    check_tenant_name,
)
from tenants.timeutil import Clock, utc_now


def quotas_of(row: Tenant) -> Quotas:
    return Quotas(
        requests_per_minute=row.requests_per_minute,
        tokens_per_minute=row.tokens_per_minute,
        max_concurrent_requests=row.max_concurrent_requests,
        monthly_token_budget=row.monthly_token_budget,
        monthly_cost_budget=row.monthly_cost_budget,
        max_prompt_tokens=row.max_prompt_tokens,
        kv_cache_share=row.kv_cache_share,
        models=None if row.models is None else tuple(row.models),
    )


def tenant_info(row: Tenant) -> TenantInfo:
    status: TenantStatus = row.status  # type: ignore[assignment]
    return TenantInfo(
        id=row.id,
        name=row.name,
        weight=row.weight,
        status=status,
        created_at=row.created_at,
        quotas=quotas_of(row),
    )


def _set_quotas(row: Tenant, quotas: Quotas) -> None:
    for name, value in msgspec.structs.asdict(quotas).items():
        setattr(row, name, list(value) if isinstance(value, tuple) else value)


_LIVE_TENANT = select(Tenant).where(Tenant.id == bindparam("of_tenant"), Tenant.status != "deleted")
_LOCK_LIVE_TENANT = _LIVE_TENANT.with_for_update()


async def load_tenant(session: AsyncSession, tenant_id: str, *, lock: bool = False) -> Tenant:
    """The live (not deleted) tenant row; TenantNotFoundError otherwise."""
    stmt = _LOCK_LIVE_TENANT if lock else _LIVE_TENANT
    row = await session.scalar(stmt, {"of_tenant": tenant_id})
    if row is None:
        raise TenantNotFoundError(f"tenant {tenant_id!r} not found")
    return row


class TenantService:
    """``on_change(tenant_id)`` runs after a committed change (to drop cached auth contexts)."""

    def __init__(
        self, db: Database, clock: Clock = utc_now, on_change: Callable[[str], None] | None = None
    ) -> None:
        self._db = db
        self._clock = clock
        self._on_change = on_change or (lambda _tenant_id: None)

    async def create(self, spec: TenantCreate, *, actor: str = "admin") -> TenantInfo:
        """A new tenant; InvalidInputError for a name outside ``TENANT_NAME``, ConflictError for
        one taken (by a deleted tenant too)."""
        check_tenant_name(spec.name)
        now = self._clock()
        row = Tenant(
            id=new_id("tn"), name=spec.name, weight=spec.weight, status="active", created_at=now
        )
        _set_quotas(row, spec.quotas)
        try:
            async with self._db.transaction() as session:
                if await session.scalar(select(Tenant.id).where(Tenant.name == spec.name)):
                    raise ConflictError(f"a tenant named {spec.name!r} exists")
                session.add(row)
                await session.flush()
                info = tenant_info(row)
                add_entry(
                    session,
                    at=now,
                    actor=actor,
                    action="tenant.create",
                    target=row.id,
                    before=None,
                    after=info,
                )
        except IntegrityError as exc:  # a concurrent create of the same name
            raise ConflictError(f"a tenant named {spec.name!r} exists") from exc
        return info

    async def get(self, tenant_id: str) -> TenantInfo:
        async with self._db.sessions() as session:
            return tenant_info(await load_tenant(session, tenant_id))

    async def resolve(self, ref: str) -> str:
        """The id of the live tenant ``ref`` names: its id, else its name (a name never looks
        like an id); TenantNotFoundError otherwise."""
        async with self._db.sessions() as session:
            for column in (Tenant.id, Tenant.name):
                found = await session.scalar(
                    select(Tenant.id).where(column == ref, Tenant.status != "deleted")
                )
                if found is not None:
                    return found
        raise TenantNotFoundError(f"tenant {ref!r} not found")

    async def list_tenants(self, *, include_deleted: bool = False) -> list[TenantInfo]:
        stmt = select(Tenant).order_by(Tenant.created_at, Tenant.id)
        if not include_deleted:
            stmt = stmt.where(Tenant.status != "deleted")
        async with self._db.sessions() as session:
            return [tenant_info(row) for row in await session.scalars(stmt)]

    async def update(
        self, tenant_id: str, patch: TenantPatch, *, actor: str = "admin"
    ) -> TenantInfo:
        now = self._clock()
        async with self._db.transaction() as session:
            row = await load_tenant(session, tenant_id, lock=True)
            before = tenant_info(row)
            if patch.weight is not UNSET:
                row.weight = patch.weight
            if patch.status is not UNSET:
                row.status = patch.status
            if patch.quotas is not UNSET:
                _set_quotas(row, patch.quotas.apply(before.quotas))
            after = tenant_info(row)
            add_entry(
                session,
                at=now,
                actor=actor,
                action="tenant.update",
                target=tenant_id,
                before=before,
                after=after,
            )
        self._on_change(tenant_id)
        return after

    async def delete(self, tenant_id: str, *, actor: str = "admin") -> TenantInfo:
        """Soft-delete: the row stays (usage and billing refer to it), every key is revoked."""
        now = self._clock()
        async with self._db.transaction() as session:
            row = await load_tenant(session, tenant_id, lock=True)
            before = tenant_info(row)
            row.status = "deleted"
            await session.execute(
                update(ApiKey)
                .where(ApiKey.tenant_id == tenant_id, ApiKey.revoked_at.is_(None))
                .values(revoked_at=now)
            )
            after = tenant_info(row)
            add_entry(
                session,
                at=now,
                actor=actor,
                action="tenant.delete",
                target=tenant_id,
                before=before,
                after=after,
            )
        self._on_change(tenant_id)
        return after
