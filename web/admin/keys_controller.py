"""Admin routes for API keys: issue (the secret is returned this once), list, revoke."""

from __future__ import annotations

from litestar import Controller, delete, get, post
from litestar.params import FromPath, JSONBody
from litestar.status_codes import HTTP_200_OK

from tenants.schemas import KeyInfo
from web.admin.context import services
from web.admin.schemas import IssuedKey, KeyCreate
from web.admin.tenants_controller import AdminRequest, actor_of

DEFAULT_KEY_NAME = "default"


class KeysController(Controller):
    tags = ["admin"]  # noqa: RUF012 - Litestar reads this class attribute

    @post("/tenants/{tenant_id:str}/keys")
    async def issue_key(
        self,
        request: AdminRequest,
        tenant_id: FromPath[str],
        data: JSONBody[KeyCreate | None] = None,
    ) -> IssuedKey:
        name = data.name if data is not None and data.name is not None else DEFAULT_KEY_NAME
        svc = await services(request)
        info, secret = await svc.keys.create_key(tenant_id, name, actor=actor_of(request))
        return IssuedKey(
            id=info.id, key=secret, prefix=info.prefix, name=info.name, created_at=info.created_at
        )

    @get("/tenants/{tenant_id:str}/keys")
    async def list_keys(self, request: AdminRequest, tenant_id: FromPath[str]) -> list[KeyInfo]:
        return await (await services(request)).keys.list_keys(tenant_id)

    @delete("/keys/{key_id:str}", status_code=HTTP_200_OK)
    async def revoke_key(self, request: AdminRequest, key_id: FromPath[str]) -> KeyInfo:
        svc = await services(request)
        return await svc.keys.revoke_key(key_id, actor=actor_of(request))
