"""PostgreSQL for gateway tests: a migrated database of the test's own, and what is stored in it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import func, select

from tenants import Database, TenantDomain
from tenants.models import RateBucket, Reservation, TokenBudget, UsageEventRow
from tenants.schemas import Quotas, TenantCreate
from tests.support.postgres import (
    migrate,
    pg_admin,
    pg_url,
    require_postgres,
)

ADMIN_TOKEN = "gateway-test-admin-token-0123456789"


@contextmanager
def migrated_database() -> Iterator[str]:
    """The name of a fresh database at the head revision, dropped afterwards."""
    require_postgres()
    name = f"atrium_gw_{uuid.uuid4().hex[:12]}"
    asyncio.run(pg_admin(f"CREATE DATABASE {name}"))
    try:
        asyncio.run(migrate(pg_url(name)))
        yield name
    finally:
        asyncio.run(pg_admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


async def create_tenant(url: str, spool: Path, name: str, quotas: Quotas, keys: int) -> list[str]:
    """A tenant with ``keys`` API keys; returns the key secrets."""
    db = await Database.connect(url)
    domain = await TenantDomain.open(db, spool_path=spool)
    try:
        tenant = await domain.tenants.create(TenantCreate(name=name, quotas=quotas))
        return [(await domain.keys.create_key(tenant.id, f"k{n}"))[1] for n in range(keys)]
    finally:
        await domain.close()


async def revoke_key_of(url: str, spool: Path, secret: str) -> None:
    """Revoke a key from outside the gateway (as another process would)."""
    db = await Database.connect(url)
    domain = await TenantDomain.open(db, spool_path=spool)
    try:
        ctx = await domain.keys.authenticate(secret)
        await domain.keys.revoke_key(ctx.key_id)
    finally:
        await domain.close()


@dataclass(frozen=True, slots=True)
class Books:
    """What the database holds about usage and reservations."""

    request_ids: list[str]
    budget_used: int
    budget_reserved: int
    reservations: int
    in_flight: int


async def read_books(url: str) -> Books:
    db = await Database.connect(url)
    try:
        async with db.sessions() as session:
            ids = list(await session.scalars(select(UsageEventRow.request_id)))
            used, reserved = (
                await session.execute(
                    select(
                        func.coalesce(func.sum(TokenBudget.used), 0),
                        func.coalesce(func.sum(TokenBudget.reserved), 0),
                    )
                )
            ).one()
            reservations = await session.scalar(select(func.count()).select_from(Reservation))
            in_flight = await session.scalar(
                select(func.coalesce(func.sum(RateBucket.in_flight), 0))
            )
        return Books(ids, int(used), int(reserved), int(reservations or 0), int(in_flight or 0))
    finally:
        await db.close()
