"""One gateway-like process of the budget race: many concurrent admissions, one JSON line out.

Usage: python budget_race_worker.py URL TENANT_ID KEY_ID WORKER START_AT_EPOCH COUNT
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from tenants import Database
from tenants.admission import AdmissionService
from tenants.errors import QuotaExceededError
from tenants.schemas import AuthContext, Quotas


async def main(
    url: str, tenant_id: str, key_id: str, worker: str, start_at: float, count: int
) -> None:
    db = await Database.connect(url)
    admission = AdmissionService(db)
    ctx = AuthContext(
        tenant_id=tenant_id,
        tenant_name="race",
        key_id=key_id,
        weight=1.0,
        status="active",
        quotas=Quotas(),
    )
    await db.ping()  # warm the pool before the common start time
    await asyncio.sleep(max(0.0, start_at - time.time()))

    async def one(i: int) -> int:
        try:
            granted = await admission.admit(ctx, f"{worker}-{i}", 60, 40)
        except QuotaExceededError:
            return 0
        return granted.reserved_tokens

    reserved = await asyncio.gather(*(one(i) for i in range(count)))
    await db.close()
    print(json.dumps({"admitted": sum(1 for r in reserved if r), "reserved": sum(reserved)}))


if __name__ == "__main__":
    url, tenant_id, key_id, worker, start_at, count = sys.argv[1:7]
    asyncio.run(main(url, tenant_id, key_id, worker, float(start_at), int(count)))
