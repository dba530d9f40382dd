"""Admin routes for API keys: issue and rotate (the secret is returned this once), list, read,
change (expiry, scopes, models, requests/min) and revoke."""

from __future__ import annotations

from litestar import Controller, delete, get, patch, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody
from litestar.status_codes import HTTP_200_OK

from tenants.key_policy import KeyPatch, KeyRotate
from tenants.schemas import KeyInfo
from web.admin.context import AdminServices
from web.admin.revocation import key_revoked
from web.admin.schemas import IssuedKey, KeyCreate
from web.admin.tenants_controller import AdminRequest, actor_of

DEFAULT_KEY_NAME = "default"


class KeysController(Controller):
    tags = ["admin"]  # noqa: RUF012 - Litestar reads this class attribute

    @post("/tenants/{tenant_id:str}/keys")
    async def issue_key(
        self,
        request: AdminRequest,
        admin_services: NamedDependency[AdminServices],
        tenant_id: FromPath[str],
        data: JSONBody[KeyCreate | None] = None,
    ) -> IssuedKey:
        spec = (data or KeyCreate()).spec(DEFAULT_KEY_NAME)
        svc = admin_services
        info, secret = await svc.keys.create_key(tenant_id, spec, actor=actor_of(request))
        return IssuedKey.of(info, secret)

    @get("/tenants/{tenant_id:str}/keys")
    async def list_keys(
        self,
        request: AdminRequest,
        admin_services: NamedDependency[AdminServices],
        tenant_id: FromPath[str],
    ) -> list[KeyInfo]:
        return await admin_services.keys.list_keys(tenant_id)

    @get("/keys/{key_id:str}")
    async def get_key(
        self,
        request: AdminRequest,
        admin_services: NamedDependency[AdminServices],
        key_id: FromPath[str],
    ) -> KeyInfo:
        return await admin_services.keys.get_key(key_id)

    @patch("/keys/{key_id:str}")
    async def update_key(
        self,
        request: AdminRequest,
        admin_services: NamedDependency[AdminServices],
        key_id: FromPath[str],
        data: JSONBody[KeyPatch],
    ) -> KeyInfo:
        svc = admin_services
        return await svc.keys.update_key(key_id, data, actor=actor_of(request))

    @post("/keys/{key_id:str}/rotate")
    async def rotate_key(
        self,
        request: AdminRequest,
        admin_services: NamedDependency[AdminServices],
        key_id: FromPath[str],
        data: JSONBody[KeyRotate | None] = None,
    ) -> IssuedKey:
        svc = admin_services
        new, secret, old = await svc.keys.rotate_key(
            key_id, data or KeyRotate(), actor=actor_of(request)
        )
        return IssuedKey.of(new, secret, retired=old)

    @delete("/keys/{key_id:str}", status_code=HTTP_200_OK)
    async def revoke_key(
        self,
        request: AdminRequest,
        admin_services: NamedDependency[AdminServices],
        key_id: FromPath[str],
    ) -> KeyInfo:
        svc = admin_services
        info = await svc.keys.revoke_key(key_id, actor=actor_of(request))
        key_revoked(request, key_id)
        return info
