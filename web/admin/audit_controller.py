"""Admin route for the audit log: admin mutations in a window, oldest first."""

from __future__ import annotations

from datetime import datetime

from litestar import get
from litestar.di import NamedDependency
from litestar.params import FromQuery

from tenants.records import AuditRecord
from web.admin.context import AdminServices
from web.admin.tenants_controller import AdminRequest
from web.admin.window import resolve_window


@get("/audit", tags=["admin"])
async def list_audit(
    request: AdminRequest,
    admin_services: NamedDependency[AdminServices],
    start: FromQuery[datetime | None] = None,
    end: FromQuery[datetime | None] = None,
) -> list[AuditRecord]:
    start_at, end_at = resolve_window(start, end)
    return await admin_services.audit.entries(start_at, end_at)
