"""How an admin command runs: against the database directly, through the `tenants/` services,
with every failure turned into one line on stderr and a non-zero exit status (never a traceback).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import msgspec
from sqlalchemy.exc import SQLAlchemyError

from tenants.audit import AuditService
from tenants.auth_cache import AuthCache
from tenants.billing import BillingService
from tenants.database import Database
from tenants.errors import TenantError
from tenants.key_service import KeyService
from tenants.lora_adapters import LoraAdapterService
from tenants.price_service import PriceService
from tenants.public_prefixes import PublicPrefixService
from tenants.server_secrets import load_key_secret
from tenants.tenant_service import TenantService
from tenants.usage_report import UsageReport
from web.settings import Settings, SettingsError

T = TypeVar("T")
CLI_ACTOR = "cli"
EXIT_FAILED = 1  # the database or the server could not be reached or refused the work
EXIT_INVALID = 2  # what was asked is wrong: bad values, unknown ids, conflicts
DIRECT_NOTE = (
    "Works on the database directly (--database-url or ATRIUM_DATABASE_URL), as the admin API "
    "does; no server needs to run."
)
TENANT_HELP = "the tenant's id (tn_…) or name"


class CommandError(Exception):
    """A failure the command explains itself; ``status`` is the exit status."""

    def __init__(self, message: str, status: int = EXIT_INVALID) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Services:
    """The tenant-domain services an admin command calls (the admin API calls the same)."""

    db: Database
    tenants: TenantService
    keys: KeyService
    prices: PriceService
    reports: UsageReport
    billing: BillingService
    audit: AuditService
    public_prefixes: PublicPrefixService
    lora_adapters: LoraAdapterService


def settings_of(args: argparse.Namespace) -> Settings:
    return Settings.load({"database_url": getattr(args, "database_url", None)})


async def open_services(settings: Settings) -> Services:
    db = await Database.connect(settings.database_url)
    try:
        if db.dialect == "sqlite":  # the embedded default migrates itself, as `serve` does
            await db.upgrade_unless_at_head()
        # The same secret the gateway hashes keys with, or the one stored in the database.
        given = settings.server_secret.encode("utf-8") if settings.server_secret else None
        secret = await load_key_secret(db, given)
    except BaseException:
        await db.close()
        raise
    prices = PriceService(db)
    return Services(
        db=db,
        tenants=TenantService(db),
        keys=KeyService(db, secret, AuthCache()),
        prices=prices,
        reports=UsageReport(db),
        billing=BillingService(db, prices),
        audit=AuditService(db),
        public_prefixes=PublicPrefixService(db),
        lora_adapters=LoraAdapterService(db),
    )


async def _with_services(settings: Settings, work: Callable[[Services], Awaitable[T]]) -> T:
    services = await open_services(settings)
    try:
        return await work(services)
    finally:
        await services.db.close()


def fail(name: str, message: str, status: int) -> int:
    first_line = (message.strip().splitlines() or ["failed"])[0]
    print(f"atrium {name}: {first_line}", file=sys.stderr)
    return status


def guarded(name: str, action: Callable[[], T]) -> T | int:
    """``action()``, or the exit status after printing why it failed on one line."""
    try:
        return action()
    except CommandError as exc:
        return fail(name, str(exc), exc.status)
    except (SettingsError, TenantError, ValueError, msgspec.ValidationError) as exc:
        return fail(name, str(exc), EXIT_INVALID)
    except (SQLAlchemyError, OSError) as exc:
        return fail(name, f"database error: {exc}", EXIT_FAILED)


def run_db(
    name: str, args: argparse.Namespace, work: Callable[[Services], Awaitable[T]]
) -> T | int:
    """Run ``work`` on the services of the database that ``args`` name."""
    return guarded(name, lambda: asyncio.run(_with_services(settings_of(args), work)))


DATABASE_HELP = (
    "SQLAlchemy URL of the tenant database, e.g. sqlite+aiosqlite:///./atrium.db or "
    "postgresql+asyncpg://user@host/db (env ATRIUM_DATABASE_URL; default: ./atrium.db)"
)


def database_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url", dest="database_url", default=None, metavar="URL", help=DATABASE_HELP
    )
