"""Admin routes for tenants: create, list, read, change weight/status/quotas, soft-delete."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, delete, get, patch, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody
from litestar.status_codes import HTTP_200_OK

from tenants.schemas import TenantCreate, TenantInfo, TenantPatch
from web.admin.context import AdminServices
from web.admin.revocation import tenant_changed

AdminRequest = Request[Any, Any, Any]


def actor_of(request: AdminRequest) -> str:
    actor = getattr(request.state, "admin_actor", None)
    return actor if isinstance(actor, str) else "admin"


class TenantsController(Controller):
    path = "/tenants"
    tags = ["admin"]  # noqa: RUF012 - Litestar reads this class attribute

    @post("/")
    async def create_tenant(
        self,
        request: AdminRequest,
        admin_services: NamedDependency[AdminServices],
        data: JSONBody[TenantCreate],
    ) -> TenantInfo:
        return await admin_services.tenants.create(data, actor=actor_of(request))

    @get("/")
    async def list_tenants(
        self, request: AdminRequest, admin_services: NamedDependency[AdminServices]
    ) -> list[TenantInfo]:
        return await admin_services.tenants.list_tenants()

    @get("/{tenant_id:str}")
    async def get_tenant(
        self,
        request: AdminRequest,
        admin_services: NamedDependency[AdminServices],
        tenant_id: FromPath[str],
    ) -> TenantInfo:
        return await admin_services.tenants.get(tenant_id)

    @patch("/{tenant_id:str}")
    async def update_tenant(
        self,
        request: AdminRequest,
        admin_services: NamedDependency[AdminServices],
        tenant_id: FromPath[str],
        data: JSONBody[TenantPatch],
    ) -> TenantInfo:
        svc = admin_services
        info = await svc.tenants.update(tenant_id, data, actor=actor_of(request))
        tenant_changed(request, info)
        return info

    @delete("/{tenant_id:str}", status_code=HTTP_200_OK)
    async def delete_tenant(
        self,
        request: AdminRequest,
        admin_services: NamedDependency[AdminServices],
        tenant_id: FromPath[str],
    ) -> TenantInfo:
        svc = admin_services
        info = await svc.tenants.delete(tenant_id, actor=actor_of(request))
        tenant_changed(request, info)
        return info
