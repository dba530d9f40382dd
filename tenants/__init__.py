"""The tenant domain in SQL: tenants, API keys, quotas, budgets, metering, prices and billing.

Start with ``Database.connect(url)`` and ``TenantDomain.open(db, spool_path=…)``.
"""

from tenants.database import Database
from tenants.domain import TenantDomain

__all__ = ["Database", "TenantDomain"]
