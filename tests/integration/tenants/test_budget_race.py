"""Two OS processes, 64 concurrent admissions, one PostgreSQL: the budget is never overspent."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from tenants.models import TokenBudget
from tenants.schemas import Quotas, TenantCreate

WORKER = Path(__file__).with_name("budget_race_worker.py")
ROOT = Path(__file__).resolve().parents[3]
BUDGET = 1_000  # room for exactly 10 requests of 60 prompt + 40 max tokens


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_budget_holds_under_64_concurrent_admissions_from_two_processes(
    open_domain, db_url: str
) -> None:
    async def setup() -> tuple[str, str]:
        async with open_domain() as domain:
            tenant = await domain.tenants.create(
                TenantCreate(name="race", quotas=Quotas(monthly_token_budget=BUDGET))
            )
            key, _ = await domain.keys.create_key(tenant.id)
            return tenant.id, key.id

    async def budget_row(tenant_id: str) -> tuple[int, int]:
        async with open_domain() as domain, domain.db.sessions() as session:
            row = await session.scalar(
                select(TokenBudget).where(TokenBudget.tenant_id == tenant_id)
            )
            assert row is not None
            return row.used, row.reserved

    tenant_id, key_id = asyncio.run(setup())
    start_at = time.time() + 2.0
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), db_url, tenant_id, key_id, f"w{n}", str(start_at), "32"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=ROOT,
            text=True,
        )
        for n in range(2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    admitted = sum(r["admitted"] for r in results)
    reserved = sum(r["reserved"] for r in results)
    used, reserved_in_db = asyncio.run(budget_row(tenant_id))
    assert reserved == reserved_in_db <= BUDGET
    assert used == 0
    # Refusals are only for lack of budget: every slot that fits was granted.
    assert admitted == BUDGET // 100
