"""The public-prefix admin routes on SQLite, without an engine: stored, listed, unpublished,
audited, and a 4xx in the error shape for every bad input."""

from __future__ import annotations

from typing import Any

from litestar import Litestar
from litestar.testing import TestClient

from tenants.public_prefixes import MAX_PREFIX_CHARS
from tests.integration.test_admin_app import admin, assert_error, db_url

__all__ = ["admin", "db_url"]  # fixtures used below
Client = TestClient[Litestar]
ROUTE = "/admin/v1/public-prefixes"


def publish(client: Client, text: str) -> dict[str, Any]:
    response = client.post(ROUTE, json={"text": text})
    assert response.status_code == 201, response.text
    return dict(response.json())


def test_publish_list_read_unpublish_and_audit(admin: Client) -> None:
    rules = publish(admin, "You are a careful assistant.")
    assert rules["id"].startswith("pp_") and rules["text"] == "You are a careful assistant."
    assert rules["created_by"] == "admin-token" and rules["unpublished_at"] is None
    # No engine in this app: nothing is held here yet (engines fetch the set themselves).
    assert rules["num_tokens"] is None and rules["num_cached_tokens"] is None
    style = publish(admin, "Answer briefly.")
    assert [p["id"] for p in admin.get(ROUTE).json()] == [rules["id"], style["id"]]
    assert admin.get(f"{ROUTE}/{style['id']}").json() == style

    gone = admin.delete(f"{ROUTE}/{rules['id']}")
    assert gone.status_code == 200, gone.text
    assert gone.json()["unpublished_by"] == "admin-token" and gone.json()["unpublished_at"]
    assert [p["id"] for p in admin.get(ROUTE).json()] == [style["id"]]
    everything = admin.get(ROUTE, params={"include_unpublished": "true"}).json()
    assert [p["id"] for p in everything] == [rules["id"], style["id"]]

    audit = admin.get("/admin/v1/audit").json()
    assert [(a["action"], a["target"]) for a in audit] == [
        ("public_prefix.publish", rules["id"]),
        ("public_prefix.publish", style["id"]),
        ("public_prefix.unpublish", rules["id"]),
    ]


def test_conflicts_and_unknown_ids(admin: Client) -> None:
    first = publish(admin, "shared rules")
    assert_error(admin.post(ROUTE, json={"text": "shared rules"}), 409, "conflict")
    admin.delete(f"{ROUTE}/{first['id']}")
    assert_error(admin.delete(f"{ROUTE}/{first['id']}"), 409, "conflict")
    assert_error(admin.delete(f"{ROUTE}/pp_unknown"), 404, "not_found")
    assert_error(admin.get(f"{ROUTE}/pp_unknown"), 404, "not_found")
    assert_error(admin.get(f"{ROUTE}/{'x' * 300}"), 404, "not_found")
    assert publish(admin, "shared rules")["id"] != first["id"]  # free again once unpublished


BAD_BODIES: list[Any] = [
    {},
    {"text": ""},
    {"text": "  \n "},
    {"text": 42},
    {"text": None},
    {"text": "a\u0000b"},
    {"text": "ok", "pin": True},
    {"text": "x" * (MAX_PREFIX_CHARS + 1)},
    [],
    "text",
]


def test_bad_bodies_are_400_and_store_nothing(admin: Client) -> None:
    for body in BAD_BODIES:
        assert_error(admin.post(ROUTE, json=body), 400)
    assert admin.get(ROUTE, params={"include_unpublished": "true"}).json() == []


def test_unreadable_bodies_and_bad_queries_are_400(admin: Client) -> None:
    headers = {"Content-Type": "application/json"}
    assert_error(admin.post(ROUTE, content=b"{not json", headers=headers), 400)
    assert_error(admin.post(ROUTE, content=b'{"text": "\\ud800"}', headers=headers), 400)
    assert_error(admin.get(ROUTE, params={"include_unpublished": "perhaps"}), 400)


def test_routes_need_the_admin_token(admin: Client) -> None:
    prefix = publish(admin, "rules")
    for method, path in (("POST", ROUTE), ("GET", ROUTE), ("DELETE", f"{ROUTE}/{prefix['id']}")):
        response = admin.request(
            method, path, json={"text": "x"}, headers={"Authorization": "Bearer wrong"}
        )
        assert_error(response, 401, "invalid_admin_token")
    assert [p["id"] for p in admin.get(ROUTE).json()] == [prefix["id"]]
