"""The admin API's key lifecycle on SQLite: expiry, scopes, models and limits on create, list
and PATCH; rotation with an overlap; every change in the audit log."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from litestar import Litestar
from litestar.testing import TestClient

from tests.integration.test_admin_api import create_tenant
from tests.integration.test_admin_app import admin, assert_error, db_url

__all__ = ["admin", "db_url"]  # fixtures used below
Client = TestClient[Litestar]
LATER = "2031-06-01T00:00:00Z"


def test_keys_carry_expiry_scopes_models_and_limit(admin: Client) -> None:
    tenant = create_tenant(admin, "acme")
    spec = {
        "name": "reader",
        "expires_at": LATER,
        "scopes": ["usage:read"],
        "models": ["tiny"],
        "requests_per_minute": 30,
    }
    issued = admin.post(f"/admin/v1/tenants/{tenant['id']}/keys", json=spec)
    assert issued.status_code == 201, issued.text
    body = issued.json()
    assert body["key"].startswith("sk-atr-") and body["replaces"] is None
    assert body["expires_at"].startswith("2031-06-01T00:00:00")
    assert (body["scopes"], body["models"], body["requests_per_minute"]) == (
        ["usage:read"],
        ["tiny"],
        30,
    )
    default = admin.post(f"/admin/v1/tenants/{tenant['id']}/keys").json()
    assert default["scopes"] == ["inference", "usage:read"] and default["models"] is None
    assert default["expires_at"] is None and default["requests_per_minute"] is None

    [listed, _] = admin.get(f"/admin/v1/tenants/{tenant['id']}/keys").json()
    assert listed["scopes"] == ["usage:read"] and listed["requests_per_minute"] == 30
    assert "key" not in listed and admin.get(f"/admin/v1/keys/{body['id']}").json() == listed

    patched = admin.patch(
        f"/admin/v1/keys/{body['id']}",
        json={"scopes": ["inference"], "models": None, "expires_at": None},
    )
    assert patched.status_code == 200, patched.text
    changed = patched.json()
    assert changed["scopes"] == ["inference"] and changed["models"] is None
    assert changed["expires_at"] is None and changed["requests_per_minute"] == 30  # untouched


def test_bad_key_input_is_a_client_error(admin: Client) -> None:
    tenant = create_tenant(admin, "acme")
    path = f"/admin/v1/tenants/{tenant['id']}/keys"
    assert_error(admin.post(path, json={"scopes": ["admin"]}), 400)
    assert_error(admin.post(path, json={"scopes": []}), 400)
    assert_error(admin.post(path, json={"models": []}), 400)
    assert_error(admin.post(path, json={"requests_per_minute": -1}), 400)
    assert_error(admin.post(path, json={"expires_at": "2031-06-01T00:00:00"}), 400)  # no zone
    key = admin.post(path).json()
    assert_error(admin.patch(f"/admin/v1/keys/{key['id']}", json={"expires_in": 5}), 400)
    assert_error(admin.patch("/admin/v1/keys/key_missing", json={"name": "x"}), 404)
    assert_error(admin.post("/admin/v1/keys/key_missing/rotate", json={}), 404)
    assert_error(
        admin.post(f"/admin/v1/keys/{key['id']}/rotate", json={"overlap_seconds": -1}), 400
    )
    admin.delete(f"/admin/v1/keys/{key['id']}")
    assert_error(admin.patch(f"/admin/v1/keys/{key['id']}", json={"name": "x"}), 409, "conflict")
    assert_error(admin.post(f"/admin/v1/keys/{key['id']}/rotate"), 409, "conflict")


def test_rotation_issues_a_successor_and_is_audited(admin: Client) -> None:
    tenant = create_tenant(admin, "acme")
    spec = {"name": "ci", "scopes": ["inference"], "requests_per_minute": 5}
    old = admin.post(f"/admin/v1/tenants/{tenant['id']}/keys", json=spec).json()
    before = datetime.now(UTC)
    rotated = admin.post(f"/admin/v1/keys/{old['id']}/rotate", json={"overlap_seconds": 3600})
    assert rotated.status_code == 201, rotated.text
    new = rotated.json()
    assert new["id"] != old["id"] and new["key"] != old["key"] and new["replaces"] == old["id"]
    assert (new["name"], new["scopes"], new["requests_per_minute"]) == ("ci", ["inference"], 5)
    until = datetime.fromisoformat(new["replaces_until"])
    assert before + timedelta(minutes=59) < until <= datetime.now(UTC) + timedelta(hours=1)
    retired = admin.get(f"/admin/v1/keys/{old['id']}").json()
    assert retired["replaced_by"] == new["id"] and retired["revoked_at"] is None
    assert_error(admin.post(f"/admin/v1/keys/{old['id']}/rotate"), 409, "conflict")
    admin.patch(f"/admin/v1/keys/{new['id']}", json={"requests_per_minute": None})

    actions = [(e["action"], e["target"]) for e in admin.get("/admin/v1/audit").json()]
    assert actions[-4:] == [
        ("key.create", old["id"]),
        ("key.create", new["id"]),
        ("key.rotate", old["id"]),
        ("key.update", new["id"]),
    ]
