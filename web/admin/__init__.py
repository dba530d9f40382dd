"""The admin API under ``/admin/v1`` (CONTRACT.md §3), behind the admin guard."""

from __future__ import annotations

from litestar import Router

from web.admin.adapters_controller import LoraAdaptersController
from web.admin.audit_controller import list_audit
from web.admin.auth import admin_guard
from web.admin.context import admin_dependencies
from web.admin.engine_controller import engine_status
from web.admin.keys_controller import KeysController
from web.admin.live_controller import live_metrics
from web.admin.prefixes_controller import PublicPrefixesController
from web.admin.spend_controller import batches, refusals, spend, tenant_statement
from web.admin.tenants_controller import TenantsController
from web.admin.usage_controller import (
    billing_export,
    billing_manifest,
    list_prices,
    set_price,
    usage,
)
from web.openai.json_body import JsonRequest

admin_router = Router(
    path="/admin/v1",
    guards=[admin_guard],
    dependencies=admin_dependencies(),
    route_handlers=[
        TenantsController,
        KeysController,
        usage,
        spend,
        tenant_statement,
        refusals,
        batches,
        billing_export,
        billing_manifest,
        set_price,
        list_prices,
        list_audit,
        engine_status,
        live_metrics,
        PublicPrefixesController,
        LoraAdaptersController,
    ],
    request_class=JsonRequest,
)

__all__ = ["admin_router"]
