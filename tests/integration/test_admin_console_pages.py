"""The console's live, engines and public-prefix pages, the keys page's expiry and rotation
controls, and the per-engine numbers of GET /admin/v1/engine they draw."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from litestar import Litestar
from litestar.testing import TestClient

from engine.stats import EngineSnapshot, EngineStats
from radix_cache.stats import NamespaceSnapshot
from tests.integration.test_admin_app import ADMIN_TOKEN, anon, build_admin_app, db_url
from tests.integration.test_admin_console import sign_in
from web.engine_api.fleet import EngineView

__all__ = ["anon", "db_url"]  # fixtures used below
Client = TestClient[Litestar]


class Fleet:
    """A router with a drafting engine that preempted twice and one that does not answer."""

    def __init__(self) -> None:
        self.fleet = self
        self.busy = EngineSnapshot(
            running_by_tenant={"tn_a": 2},
            num_pages_total=100,
            num_pages_free=50,
            num_pages_available=70,
            counters=EngineStats(
                num_preemptions=2, num_draft_tokens=40, num_accepted_draft_tokens=30
            ),
            cache_by_namespace={
                "tenant:tn_a": NamespaceSnapshot(
                    "tenant:tn_a", 9, 0, None, 1.0, None, 1, 8, 4, 0, 0
                )
            },
        )

    def stats(self) -> EngineSnapshot:
        return self.busy

    async def poll(self) -> list[EngineView]:
        return [
            EngineView("http://a", True, self.busy),
            EngineView("http://b", False, EngineSnapshot()),
        ]


def test_each_engine_reports_cache_preemptions_drafts_and_its_tenants(db_url: str) -> None:
    with TestClient(build_admin_app(db_url, engine=Fleet())) as client:
        client.headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
        a, b = client.get("/admin/v1/engine").json()["engines"]
        assert (a["url"], a["healthy"], b["url"], b["healthy"]) == (
            "http://a",
            True,
            "http://b",
            False,
        )
        assert a["kv_pages_cached"] == 20 and a["num_preemptions"] == 2
        assert a["draft_acceptance"] == 0.75 and b["draft_acceptance"] is None
        [tenant] = a["tenants"]
        assert (tenant["tenant_id"], tenant["running"], tenant["kv_pages_cached"]) == ("tn_a", 2, 9)
        assert tenant["hit_rate"] == 0.5 and b["tenants"] == []


def test_new_pages_need_a_session_and_render_their_parts(anon: Client) -> None:
    for path in ("/admin/live", "/admin/engines", "/admin/prefixes"):
        response = anon.get(path, follow_redirects=False)
        assert response.status_code == 303 and response.headers["location"] == "/admin/"
    sign_in(anon)
    live = anon.get("/admin/live").text
    for chart in ("tokens", "ttft", "itl", "queue", "kv", "refusals"):
        assert f'data-chart="{chart}"' in live
    assert "vendor/chart.umd.min.js" in live and "console/live.js" in live
    assert 'id="engine-card"' in anon.get("/admin/engines").text
    assert 'id="prefix-publish"' in anon.get("/admin/prefixes").text
    for path in (
        "/admin/static/console/live.js",
        "/admin/static/console/engines.js",
        "/admin/static/console/prefixes.js",
    ):
        script = anon.get(path)
        assert script.status_code == 200 and "http" not in script.text  # nothing from elsewhere


def test_keys_page_shows_expiry_rotation_and_status(anon: Client) -> None:
    anon.headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
    tenant = anon.post("/admin/v1/tenants", json={"name": "acme"}).json()
    soon = (datetime.now(UTC) + timedelta(days=2)).replace(microsecond=0)
    kept = anon.post(f"/admin/v1/tenants/{tenant['id']}/keys", json={"name": "kept"}).json()
    old = anon.post(
        f"/admin/v1/tenants/{tenant['id']}/keys",
        json={"name": "old", "expires_at": soon.isoformat()},
    ).json()
    anon.post(f"/admin/v1/keys/{old['id']}/rotate", json={"overlap_seconds": 600})
    gone = anon.post(f"/admin/v1/tenants/{tenant['id']}/keys", json={"name": "gone"}).json()
    past = (datetime.now(UTC) - timedelta(minutes=1)).isoformat()
    assert anon.patch(f"/admin/v1/keys/{gone['id']}", json={"expires_at": past}).status_code == 200
    del anon.headers["Authorization"]
    sign_in(anon)
    page = anon.get("/admin/keys", params={"tenant_id": tenant["id"]}).text

    def row(key_id: str) -> str:
        start = page.index(f'data-key-id="{key_id}"')
        return page[start : page.index("</tr>", start)]

    def dialog(key_id: str) -> str:  # a key's Manage dialog, after the table
        start = page.index(f'<dialog id="manage-{key_id}"')
        return page[start : page.index("</dialog>", start)]

    assert "active" in row(kept["id"]) and "never" in row(kept["id"])
    assert "Manage" in row(kept["id"]) and 'class="grid key-rotate"' in dialog(kept["id"])
    assert "rotated: works until" in row(old["id"]) and "key-rotate" not in dialog(old["id"])
    assert "status-expired" in row(gone["id"]) and "Manage" not in row(gone["id"])
    assert f'id="manage-{gone["id"]}"' not in page
