"""A tenant's weight and KV-cache share, set through the admin API, reach the engine's request."""

from __future__ import annotations

from pathlib import Path

from litestar.testing import TestClient

from tests.integration.gateway_fakes import MODEL, make_runtime
from tests.integration.test_admin_app import ADMIN_TOKEN, migrated_sqlite
from web.app import create_app
from web.settings import Settings


def test_weight_and_kv_share_set_by_the_admin_api_reach_the_engine(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    url = migrated_sqlite(tmp_path / "gateway.db")
    settings = Settings(
        database_url=url,
        admin_token=ADMIN_TOKEN,
        usage_spool_path=str(tmp_path / "usage.spool"),
    )
    runtime, engine = make_runtime(tiny_llama_dir)
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    with TestClient(create_app(settings, runtime)) as client:
        tenant = client.post(
            "/admin/v1/tenants", json={"name": "acme", "weight": 2.5}, headers=admin
        )
        assert tenant.status_code == 201, tenant.text
        tenant_id = tenant.json()["id"]
        key = client.post(f"/admin/v1/tenants/{tenant_id}/keys", json={}, headers=admin).json()
        tenant_auth = {"Authorization": f"Bearer {key['key']}"}

        first = client.post("/v1/completions", json=body, headers=tenant_auth)
        assert first.status_code == 200, first.text
        assert engine.requests[-1].tenant_id == tenant_id
        assert engine.requests[-1].tenant_weight == 2.5
        assert engine.requests[-1].kv_cache_share is None

        patch = {"weight": 4.0, "quotas": {"kv_cache_share": 0.25}}
        changed = client.patch(f"/admin/v1/tenants/{tenant_id}", json=patch, headers=admin)
        assert changed.status_code == 200, changed.text
        # The very next request carries the new values (no stale authentication cache).
        second = client.post("/v1/completions", json=body, headers=tenant_auth)
        assert second.status_code == 200, second.text
        assert engine.requests[-1].tenant_weight == 4.0
        assert engine.requests[-1].kv_cache_share == 0.25
