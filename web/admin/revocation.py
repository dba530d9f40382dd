"""What an admin revocation tells the running gateway beyond the database: its fallback key
cache (so an outage cannot revive the key) and, for a tenant gone, the engine's cached pages."""

from __future__ import annotations

from typing import Any

from litestar.connection import ASGIConnection

from tenants.schemas import TenantInfo
from web.admin.context import app_state

GONE_STATUSES = ("suspended", "deleted")


def key_revoked(connection: ASGIConnection[Any, Any, Any, Any], key_id: str) -> None:
    tenancy = app_state(connection).get("tenancy")
    revoked = getattr(tenancy, "key_revoked", None)
    if callable(revoked):
        revoked(key_id)


def tenant_changed(connection: ASGIConnection[Any, Any, Any, Any], info: TenantInfo) -> None:
    """A suspended or deleted tenant's keys stop working here at once, even through a database
    outage, and its prefix-cache pages are freed (dropped, not left to age out)."""
    if info.status not in GONE_STATUSES:
        return
    state = app_state(connection)
    gone = getattr(state.get("tenancy"), "tenant_gone", None)
    if callable(gone):
        gone(info.id, info.status)
        return
    drop = getattr(state.get("engine"), "drop_tenant", None)
    if callable(drop):  # a gateway without SQL tenancy: the engine alone
        drop(info.id)
