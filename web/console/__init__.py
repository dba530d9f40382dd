"""The admin web console under ``/admin/`` (CONTRACT.md §4): pages, sign-in, static assets."""

from __future__ import annotations

from pathlib import Path

from litestar import Router
from litestar.static_files import create_static_files_router

from web.console.pages import (
    audit_page,
    billing_page,
    engines_page,
    live_page,
    overview,
    prefixes_page,
    usage_page,
)
from web.console.signin import sign_in, sign_out
from web.console.tenant_pages import batches_page, keys_page, tenant_page, tenants_page
from web.openai.json_body import JsonRequest

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"

console_router = Router(
    path="/admin",
    route_handlers=[
        overview,
        live_page,
        engines_page,
        tenants_page,
        tenant_page,
        keys_page,
        batches_page,
        prefixes_page,
        usage_page,
        billing_page,
        audit_page,
        sign_in,
        sign_out,
        create_static_files_router(path="/static", directories=[STATIC_DIR], name="console_static"),
    ],
    include_in_schema=False,
    request_class=JsonRequest,
)

__all__ = ["console_router"]
