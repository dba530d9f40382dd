"""All tenant services over one database, wired once per process (what the gateway holds)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tenants.admission import AdmissionService
from tenants.audit import AuditService
from tenants.auth_cache import AuthCache
from tenants.billing import BillingService
from tenants.database import Database
from tenants.key_service import KeyService
from tenants.leases import LeaseService
from tenants.lora_adapters import LoraAdapterService
from tenants.meter import UsageMeter
from tenants.price_service import PriceService
from tenants.public_prefixes import PublicPrefixService
from tenants.server_secrets import load_key_secret
from tenants.tenant_service import TenantService
from tenants.timeutil import Clock, utc_now
from tenants.usage_report import UsageReport
from tenants.usage_store import UsageStore


@dataclass(frozen=True, slots=True)
class TenantDomain:
    db: Database
    tenants: TenantService
    keys: KeyService
    admission: AdmissionService
    prices: PriceService
    reports: UsageReport
    billing: BillingService
    audit: AuditService
    meter: UsageMeter
    leases: LeaseService
    public_prefixes: PublicPrefixService
    lora_adapters: LoraAdapterService

    @classmethod
    async def open(
        cls,
        db: Database,
        *,
        spool_path: Path,
        key_secret: bytes | None = None,
        clock: Clock = utc_now,
        auth_cache_ttl_s: float = 1.0,
    ) -> TenantDomain:
        """Wire the services on a migrated database. The meter is not started here:
        call ``await domain.meter.start()`` in a process that records usage."""
        secret = await load_key_secret(db, key_secret)
        cache = AuthCache(ttl_s=auth_cache_ttl_s)
        prices = PriceService(db, clock)
        return cls(
            db=db,
            tenants=TenantService(db, clock, on_change=cache.drop_tenant),
            keys=KeyService(db, secret, cache, clock),
            admission=AdmissionService(db, clock),
            prices=prices,
            reports=UsageReport(db),
            billing=BillingService(db, prices),
            audit=AuditService(db),
            meter=UsageMeter(UsageStore(db), spool_path),
            leases=LeaseService(db, clock),
            public_prefixes=PublicPrefixService(db, clock),
            lora_adapters=LoraAdapterService(db, clock),
        )

    async def close(self) -> None:
        """Drain the meter (if started), then close the database."""
        await self.meter.close()
        await self.db.close()
