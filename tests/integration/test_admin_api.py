"""The admin API on SQLite: tenants, keys, prices, usage, billing export, audit, engine state."""

from __future__ import annotations

import asyncio
import csv
import hashlib
import io
import json
from datetime import UTC, datetime
from typing import Any

from litestar import Litestar
from litestar.testing import TestClient

from engine.stats import EngineSnapshot, EngineStats
from tenants.database import Database
from tenants.records import UsageEvent
from tenants.usage_store import UsageStore
from tests.integration.test_admin_app import (
    ADMIN_TOKEN,
    admin,
    assert_error,
    build_admin_app,
    db_url,
)

__all__ = ["admin", "db_url"]  # fixtures used below
Client = TestClient[Litestar]
HOUR_9 = datetime(2025, 3, 4, 9, 15, tzinfo=UTC)


def record_usage(url: str, events: list[UsageEvent]) -> None:
    async def write() -> None:
        db = await Database.connect(url)
        try:
            await UsageStore(db).write(events)
        finally:
            await db.close()

    asyncio.run(write())


def event(request_id: str, tenant_id: str, at: datetime, **tokens: int) -> UsageEvent:
    counts = {"prompt_tokens": 100, "cached_tokens": 40, "completion_tokens": 10} | tokens
    return UsageEvent(
        request_id=request_id,
        tenant_id=tenant_id,
        key_id=None,
        model="tiny",
        status="ok",
        started_at=at,
        finished_at=at,
        **counts,
    )


def create_tenant(client: Client, name: str, **fields: Any) -> dict[str, Any]:
    response = client.post("/admin/v1/tenants", json={"name": name, **fields})
    assert response.status_code == 201, response.text
    return dict(response.json())


def test_tenant_lifecycle(admin: Client) -> None:
    tenant = create_tenant(admin, "acme", weight=2.0, quotas={"requests_per_minute": 60})
    assert tenant["name"] == "acme" and tenant["weight"] == 2.0 and tenant["status"] == "active"
    assert tenant["quotas"]["requests_per_minute"] == 60
    assert tenant["quotas"]["tokens_per_minute"] is None
    assert admin.get(f"/admin/v1/tenants/{tenant['id']}").json() == tenant

    patch = {"weight": 3.5, "status": "suspended", "quotas": {"kv_cache_share": 0.25}}
    changed = admin.patch(f"/admin/v1/tenants/{tenant['id']}", json=patch).json()
    assert changed["weight"] == 3.5 and changed["status"] == "suspended"
    assert changed["quotas"]["kv_cache_share"] == 0.25
    assert changed["quotas"]["requests_per_minute"] == 60  # untouched quotas stay

    assert [t["id"] for t in admin.get("/admin/v1/tenants").json()] == [tenant["id"]]
    deleted = admin.delete(f"/admin/v1/tenants/{tenant['id']}")
    assert deleted.status_code == 200 and deleted.json()["status"] == "deleted"
    assert admin.get("/admin/v1/tenants").json() == []
    assert_error(admin.get(f"/admin/v1/tenants/{tenant['id']}"), 404)


def test_bad_tenant_input_is_a_client_error(admin: Client) -> None:
    create_tenant(admin, "acme")
    assert_error(admin.post("/admin/v1/tenants", json={"name": "acme"}), 409, "conflict")
    assert_error(admin.post("/admin/v1/tenants", json={"name": "x", "colour": "red"}), 400)
    assert_error(admin.post("/admin/v1/tenants", json={"name": "y", "weight": -1}), 400)
    assert_error(admin.post("/admin/v1/tenants", json={"weight": 1}), 400)
    bad_name = assert_error(admin.post("/admin/v1/tenants", json={"name": "bad name!"}), 400)
    assert bad_name["param"] == "name" and "lowercase letters, digits" in bad_name["message"]
    assert_error(admin.post("/admin/v1/tenants", content=b"{not json"), 400)
    bad_share = {"name": "z", "quotas": {"kv_cache_share": 1.5}}
    assert_error(admin.post("/admin/v1/tenants", json=bad_share), 400)
    assert_error(admin.patch("/admin/v1/tenants/tn_missing", json={"weight": 2}), 404)
    tenant_id = admin.get("/admin/v1/tenants").json()[0]["id"]
    assert_error(admin.patch(f"/admin/v1/tenants/{tenant_id}", json={"status": "deleted"}), 400)


def test_keys_are_shown_once_and_revocable(admin: Client) -> None:
    tenant = create_tenant(admin, "acme")
    issued = admin.post(f"/admin/v1/tenants/{tenant['id']}/keys", json={"name": "ci"})
    assert issued.status_code == 201
    body = issued.json()
    assert {"id", "key", "prefix", "name", "created_at", "expires_at", "scopes"} <= set(body)
    assert body["name"] == "ci" and body["prefix"] in body["key"]
    unnamed = admin.post(f"/admin/v1/tenants/{tenant['id']}/keys").json()
    assert unnamed["key"] != body["key"]

    listed = admin.get(f"/admin/v1/tenants/{tenant['id']}/keys").json()
    assert [k["id"] for k in listed] == [body["id"], unnamed["id"]]
    assert body["key"] not in json.dumps(listed) and all("key" not in k for k in listed)

    revoked = admin.delete(f"/admin/v1/keys/{body['id']}")
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    after = {
        k["id"]: k["revoked_at"] for k in admin.get(f"/admin/v1/tenants/{tenant['id']}/keys").json()
    }
    assert after[body["id"]] is not None and after[unnamed["id"]] is None
    assert_error(admin.delete("/admin/v1/keys/key_missing"), 404)
    assert_error(admin.post("/admin/v1/tenants/tn_missing/keys", json={}), 404)
    assert_error(admin.post(f"/admin/v1/tenants/{tenant['id']}/keys", json={"nm": "x"}), 400)


def test_prices_are_set_and_listed(admin: Client) -> None:
    price = {
        "input_per_million": 150_000,
        "cached_input_per_million": 15_000,
        "output_per_million": 600_000,
        "currency": "EUR",
        "effective_from": "2025-01-01T00:00:00Z",
    }
    response = admin.put("/admin/v1/prices/org/tiny-model", json=price)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "org/tiny-model"
    listed = admin.get("/admin/v1/prices").json()
    assert [(p["model"], p["currency"], p["output_per_million"]) for p in listed] == [
        ("org/tiny-model", "EUR", 600_000)
    ]
    assert_error(admin.put("/admin/v1/prices/tiny", json=price | {"currency": "euro"}), 400)
    assert_error(admin.put("/admin/v1/prices/tiny", json=price | {"input_per_million": -1}), 400)
    assert_error(admin.put("/admin/v1/prices/tiny", json={"input_per_million": 1}), 400)
    assert listed[0]["batch_discount_percent"] == 0
    discounted = admin.put("/admin/v1/prices/tiny", json=price | {"batch_discount_percent": 50})
    assert discounted.json()["batch_discount_percent"] == 50
    too_much = price | {"batch_discount_percent": 101}
    assert_error(admin.put("/admin/v1/prices/tiny", json=too_much), 400)


def test_usage_buckets_by_hour_and_day(admin: Client, db_url: str) -> None:
    a = create_tenant(admin, "a")["id"]
    b = create_tenant(admin, "b")["id"]
    record_usage(
        db_url,
        [
            event("r1", a, HOUR_9),
            event("r2", a, HOUR_9.replace(minute=50)),
            event("r3", a, HOUR_9.replace(hour=11)),
            event("r4", b, HOUR_9, prompt_tokens=7, cached_tokens=0, completion_tokens=3),
        ],
    )
    window = {"start": "2025-03-04T00:00:00Z", "end": "2025-03-05T00:00:00Z"}
    hourly = admin.get("/admin/v1/usage", params=window | {"tenant_id": a}).json()
    assert [(h["start"][:13], h["requests"], h["prompt_tokens"]) for h in hourly] == [
        ("2025-03-04T09", 2, 200),
        ("2025-03-04T11", 1, 100),
    ]
    daily = admin.get("/admin/v1/usage", params=window | {"granularity": "day"}).json()
    by_tenant = {d["tenant_id"]: d for d in daily}
    assert by_tenant[a]["requests"] == 3 and by_tenant[a]["cached_tokens"] == 120
    assert by_tenant[b]["completion_tokens"] == 3
    # end is exclusive: a window ending at 09:00 sees nothing of 09:xx
    early = admin.get(
        "/admin/v1/usage", params={"start": "2025-03-04T00:00:00Z", "end": "2025-03-04T09:00:00Z"}
    ).json()
    assert early == []
    assert_error(admin.get("/admin/v1/usage", params=window | {"granularity": "week"}), 400)
    assert_error(admin.get("/admin/v1/usage", params={"start": "yesterday"}), 400)
    swapped = {"start": window["end"], "end": window["start"]}
    assert_error(admin.get("/admin/v1/usage", params=swapped), 400)


def test_billing_export_carries_its_manifest(admin: Client, db_url: str) -> None:
    a = create_tenant(admin, "a")["id"]
    admin.put(
        "/admin/v1/prices/tiny",
        json={
            "input_per_million": 2_000_000,
            "cached_input_per_million": 1_000_000,
            "output_per_million": 4_000_000,
            "effective_from": "2025-01-01T00:00:00Z",
        },
    )
    record_usage(db_url, [event("r1", a, HOUR_9), event("r2", a, HOUR_9)])
    window = {"start": "2025-03-01T00:00:00Z", "end": "2025-04-01T00:00:00Z"}

    response = admin.get("/admin/v1/billing/export", params=window | {"format": "csv"})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/csv")
    assert "attachment" in response.headers["content-disposition"]
    assert (
        response.headers["x-atrium-manifest-sha256"] == hashlib.sha256(response.content).hexdigest()
    )
    rows = list(csv.DictReader(io.StringIO(response.text)))
    assert len(rows) == 1 and rows[0]["tenant_name"] == "a" and rows[0]["requests"] == "2"
    assert response.headers["x-atrium-row-count"] == "1"
    assert response.headers["x-atrium-total-prompt-tokens"] == "200"
    # 2 × (60 uncached × 2 + 40 cached × 1 + 10 out × 4) per million = 0.0004 USD
    assert response.headers["x-atrium-total-cost-micros"] == "USD:400"

    manifest = admin.get("/admin/v1/billing/manifest", params=window | {"format": "csv"}).json()
    assert manifest["sha256"] == response.headers["x-atrium-manifest-sha256"]
    assert manifest["requests"] == 2 and manifest["cost_micros"] == {"USD": 400}
    again = admin.get("/admin/v1/billing/export", params=window | {"format": "csv"})
    assert again.content == response.content

    jsonl = admin.get("/admin/v1/billing/export", params=window | {"format": "jsonl"})
    assert [json.loads(line)["requests"] for line in jsonl.text.splitlines()] == [2]
    assert_error(admin.get("/admin/v1/billing/export", params=window | {"format": "xml"}), 400)
    assert_error(admin.get("/admin/v1/billing/export", params={"format": "csv"}), 400)


def test_audit_lists_mutations_oldest_first(admin: Client) -> None:
    tenant = create_tenant(admin, "acme")
    admin.patch(f"/admin/v1/tenants/{tenant['id']}", json={"weight": 4})
    key = admin.post(f"/admin/v1/tenants/{tenant['id']}/keys", json={}).json()
    admin.delete(f"/admin/v1/keys/{key['id']}")
    entries = admin.get("/admin/v1/audit").json()
    assert [e["action"] for e in entries] == [
        "tenant.create",
        "tenant.update",
        "key.create",
        "key.revoke",
    ]
    assert {e["actor"] for e in entries} == {"admin-token"}
    update = entries[1]
    assert update["target"] == tenant["id"]
    assert update["before"]["weight"] == 1.0 and update["after"]["weight"] == 4.0
    assert key["key"] not in json.dumps(entries)
    window = {"start": "2000-01-01T00:00:00Z", "end": "2000-01-02T00:00:00Z"}
    assert admin.get("/admin/v1/audit", params=window).json() == []


class FakeEngine:
    def stats(self) -> EngineSnapshot:
        return EngineSnapshot(
            running_by_tenant={"tn_a": 2},
            waiting_by_tenant={"tn_a": 1},
            num_pages_total=100,
            num_pages_free=60,
            counters=EngineStats(num_prefill_tokens=30, num_cached_tokens=10),
        )


def test_engine_state(db_url: str) -> None:
    with TestClient(build_admin_app(db_url, engine=FakeEngine())) as client:
        client.headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
        state = client.get("/admin/v1/engine").json()
        assert state["num_running"] == 2 and state["num_waiting"] == 1
        assert state["kv_pages_total"] == 100 and state["kv_pages_free"] == 60
        assert state["hit_rate"] == 0.25
        assert state["tenants"][0]["tenant_id"] == "tn_a"
        (local,) = state["engines"]  # the gateway's own engine, listed as one
        assert (local["url"], local["kv_pages_total"], local["num_running"]) == ("local", 100, 2)


def test_an_engine_without_a_state_report(db_url: str) -> None:
    class StatsOnly:
        def stats(self) -> EngineSnapshot:
            return EngineSnapshot()

    with TestClient(build_admin_app(db_url, engine=StatsOnly())) as client:
        client.headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
        assert client.get("/admin/v1/engine").json()["tenants"] == []


def test_engine_routes_without_an_engine(admin: Client) -> None:
    assert_error(admin.get("/admin/v1/engine"), 503, "engine_unavailable")
