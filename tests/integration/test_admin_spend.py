"""Admin routes on spend: cost by tenant, key and model; a tenant's statement with what is
used and left; refusals by tenant; every tenant's batches with progress and usage."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from litestar import Litestar
from litestar.testing import TestClient

from tenants.batch_files import FileService
from tenants.batch_store import BatchStore
from tenants.database import Database
from tenants.errors import QuotaExceededError, TenantSuspendedError
from tenants.records import UsageEvent
from tenants.usage_store import UsageStore
from tests.integration.test_admin_app import ADMIN_TOKEN, assert_error, build_admin_app, db_url
from web.ops.refusals import RefusalLog

__all__ = ["db_url"]  # fixture used below
Client = TestClient[Litestar]
NOW = datetime.now(UTC).replace(microsecond=0)


@dataclass
class Generation:
    """What the admin routes read of a gateway's generation service: its refusal log."""

    refusals: RefusalLog


def event(n: int, tenant: str, key: str, model: str, **fields: Any) -> UsageEvent:
    values: dict[str, Any] = {
        "prompt_tokens": 1000,
        "cached_tokens": 0,
        "completion_tokens": 100,
        "status": "ok",
        "started_at": NOW - timedelta(minutes=5),
        "finished_at": NOW - timedelta(minutes=4),
    } | fields
    return UsageEvent(request_id=f"req-{n}", tenant_id=tenant, key_id=key, model=model, **values)


def write(url: str, events: list[UsageEvent]) -> None:
    async def run() -> None:
        db = await Database.connect(url)
        try:
            await UsageStore(db).write(events)
        finally:
            await db.close()

    asyncio.run(run())


def make_batch(url: str, tenant: str, key: str, lines: int) -> str:
    async def run() -> str:
        db = await Database.connect(url)
        try:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            content = "".join(
                json.dumps(
                    {"custom_id": f"c{n}", "method": "POST", "url": "/v1/chat/completions",
                     "body": body}
                ) + "\n"
                for n in range(lines)
            ).encode()  # fmt: skip
            upload = await FileService(db).upload(tenant, "in.jsonl", content, max_lines=100)
            batch = await BatchStore(db).create(
                tenant, key, input_file_id=upload.id, endpoint="/v1/chat/completions",
                completion_window="24h", max_lines=100,
            )  # fmt: skip
            return batch.id
        finally:
            await db.close()

    return asyncio.run(run())


def test_spend_by_key_and_model_priced_and_a_statement_with_budgets_left(db_url: str) -> None:
    log = RefusalLog()
    app = build_admin_app(db_url, generation=Generation(log))
    with TestClient(app) as admin:
        admin.headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
        quotas = {"monthly_token_budget": 5000, "monthly_cost_budget": 20_000_000}
        acme = admin.post("/admin/v1/tenants", json={"name": "acme", "quotas": quotas}).json()
        other = admin.post("/admin/v1/tenants", json={"name": "other"}).json()
        keys = [
            admin.post(f"/admin/v1/tenants/{acme['id']}/keys", json={"name": name}).json()["id"]
            for name in ("web", "ci")
        ]
        other_key = admin.post(f"/admin/v1/tenants/{other['id']}/keys", json={}).json()["id"]
        price = {"input_per_million": 2_000_000, "cached_input_per_million": 0,
                 "output_per_million": 10_000_000,
                 "effective_from": (NOW - timedelta(days=1)).isoformat()}  # fmt: skip
        assert admin.put("/admin/v1/prices/big", json=price).status_code == 200
        write(
            db_url,
            [
                event(1, acme["id"], keys[0], "big", charge_budget=True),
                event(2, acme["id"], keys[0], "big", status="error", charge_budget=True),
                event(3, acme["id"], keys[1], "small", charge_budget=True),
                event(4, other["id"], other_key, "big"),
            ],
        )
        rows = admin.get("/admin/v1/spend", params={"tenant_id": acme["id"]}).json()
        by = {(r["key_id"], r["model"]): r for r in rows}
        assert set(by) == {(keys[0], "big"), (keys[1], "small")}
        big = by[(keys[0], "big")]
        assert (big["requests"], big["failed"], big["prompt_tokens"]) == (2, 1, 2000)
        assert big["key_name"] == "web"
        # 2,000 prompt tokens at 2.00 and 200 completion tokens at 10.00 per million
        assert (big["cost_micros"], big["currency"]) == (2000 * 2 + 200 * 10, "USD")
        small = by[(keys[1], "small")]
        assert (small["cost_micros"], small["currency"]) == (0, "")  # no price: no cost
        everyone = admin.get("/admin/v1/spend").json()
        assert {r["tenant_id"] for r in everyone} == {acme["id"], other["id"]}

        statement = admin.get(f"/admin/v1/tenants/{acme['id']}/statement").json()
        budget = statement["budget"]
        assert (budget["limit"], budget["used"], budget["remaining"]) == (5000, 3300, 1700)
        assert budget["cost_limit"] == 20_000_000
        assert statement["rate_limits"]["in_flight"] == 0
        missing = admin.get("/admin/v1/tenants/tn_missing/statement")
        assert_error(missing, 404)

        log.record(acme["id"], keys[0], QuotaExceededError("over", reason="monthly_token_budget",
                                                           retry_after_s=60.0))  # fmt: skip
        log.record(acme["id"], keys[0], TenantSuspendedError("suspended"))
        log.record(other["id"], other_key, ValueError("a bug is no refusal"))
        refused = admin.get("/admin/v1/refusals", params={"tenant_id": acme["id"]}).json()
        assert refused["counted"] is True
        assert {(t["reason"], t["count"]) for t in refused["totals"]} == {
            ("monthly_token_budget", 1),
            ("tenant_suspended", 1),
        }
        newest = refused["recent"][0]
        assert (newest["status"], newest["reason"], newest["key_id"]) == (
            403, "tenant_suspended", keys[0],
        )  # fmt: skip
        assert admin.get("/admin/v1/refusals").json()["totals"] == refused["totals"]
        assert_error(admin.get("/admin/v1/refusals", params={"limit": 0}), 400)


def test_batches_of_every_tenant_with_usage(db_url: str) -> None:
    with TestClient(build_admin_app(db_url)) as admin:
        admin.headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
        acme = admin.post("/admin/v1/tenants", json={"name": "acme"}).json()
        key = admin.post(f"/admin/v1/tenants/{acme['id']}/keys", json={}).json()["id"]
        first = make_batch(db_url, acme["id"], key, lines=3)
        second = make_batch(db_url, acme["id"], key, lines=2)
        write(
            db_url,
            [
                event(
                    n,
                    acme["id"],
                    key,
                    "m",
                    batch_id=first,
                    started_at=datetime.now(UTC),
                    cached_tokens=400,
                )
                for n in range(2)
            ]
            + [event(9, acme["id"], key, "m")],  # an interactive request: no batch's
        )
        listed = admin.get("/admin/v1/batches").json()
        assert [b["id"] for b in listed] == [second, first]  # newest first
        usage = {b["id"]: b["usage"] for b in listed}
        assert usage[first] == {"input_tokens": 2000, "cached_tokens": 800, "output_tokens": 200}
        assert usage[second] == {"input_tokens": 0, "cached_tokens": 0, "output_tokens": 0}
        assert listed[1]["request_counts"] == {"total": 3, "completed": 0, "failed": 0}
        done = admin.get("/admin/v1/batches", params={"status": "completed"}).json()
        assert done == []
        assert admin.get("/admin/v1/batches", params={"tenant_id": "tn_none"}).json() == []
        assert_error(admin.get("/admin/v1/batches", params={"status": "running"}), 400, None)
