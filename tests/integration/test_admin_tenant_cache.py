"""Suspending or deleting a tenant through the admin API frees its prefix-cache pages."""

from __future__ import annotations

from litestar.testing import TestClient

from tests.integration.test_admin_api import create_tenant
from tests.integration.test_admin_app import ADMIN_TOKEN, build_admin_app, db_url

__all__ = ["db_url"]  # fixture used below


def test_suspending_or_deleting_a_tenant_drops_its_cached_pages_in_the_engine(
    db_url: str,
) -> None:
    class DroppingEngine:
        def __init__(self) -> None:
            self.dropped: list[str] = []

        def drop_tenant(self, tenant_id: str) -> None:
            self.dropped.append(tenant_id)

    engine = DroppingEngine()
    with TestClient(build_admin_app(db_url, engine=engine)) as client:
        client.headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
        a, b = create_tenant(client, "a")["id"], create_tenant(client, "b")["id"]
        client.patch(f"/admin/v1/tenants/{a}", json={"weight": 2.0})
        assert engine.dropped == []  # still active: its cache is its own to keep
        client.patch(f"/admin/v1/tenants/{a}", json={"status": "suspended"})
        assert client.delete(f"/admin/v1/tenants/{b}").status_code == 200
        assert engine.dropped == [a, b]
