"""Admin routes for public prefixes: publish, list, read, unpublish (stored in SQL, audited).

A change made here reaches this gateway's own engine before the answer (all-in-one); engines
of the engine role fetch the published set from the gateway (``web.tenancy.prefix_feed``).
"""

from __future__ import annotations

import structlog
from litestar import Controller, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody
from litestar.status_codes import HTTP_200_OK, HTTP_201_CREATED

from engine.errors import EngineError
from tenants.public_prefixes import PublicPrefixInfo
from web.admin.context import AdminServices
from web.admin.schemas import PublicPrefix, PublicPrefixCreate
from web.admin.tenants_controller import AdminRequest, actor_of
from web.tenancy.prefix_delivery import PrefixDelivery

log = structlog.get_logger("atrium.admin")


def _view(info: PublicPrefixInfo, delivery: PrefixDelivery | None) -> PublicPrefix:
    held = None if delivery is None else delivery.held(info.id)
    return PublicPrefix(
        id=info.id,
        text=info.text,
        created_at=info.created_at,
        created_by=info.created_by,
        unpublished_at=info.unpublished_at,
        unpublished_by=info.unpublished_by,
        num_tokens=None if held is None else held.num_tokens,
        num_cached_tokens=None if held is None else held.num_cached_tokens,
        engine_error=None if held is None else held.error,
    )


async def _deliver(delivery: PrefixDelivery | None) -> None:
    """Bring the engine up to date now; the row is stored either way and the poll retries."""
    if delivery is None:
        return
    try:
        await delivery.refresh()
    except EngineError as exc:
        log.warning("public_prefix_delivery_failed", error=repr(exc))


class PublicPrefixesController(Controller):
    path = "/public-prefixes"
    tags = ["admin"]  # noqa: RUF012 - Litestar reads this class attribute

    @post("/", status_code=HTTP_201_CREATED)
    async def publish(
        self,
        request: AdminRequest,
        admin_services: NamedDependency[AdminServices],
        prefix_delivery: NamedDependency[PrefixDelivery | None],
        data: JSONBody[PublicPrefixCreate],
    ) -> PublicPrefix:
        delivery = prefix_delivery
        if delivery is not None:
            await delivery.check(data.text)
        svc = admin_services
        info = await svc.public_prefixes.publish(data.text, actor=actor_of(request))
        await _deliver(delivery)
        return _view(info, delivery)

    @get("/")
    async def list_prefixes(
        self,
        request: AdminRequest,
        admin_services: NamedDependency[AdminServices],
        prefix_delivery: NamedDependency[PrefixDelivery | None],
        include_unpublished: FromQuery[bool] = False,
    ) -> list[PublicPrefix]:
        svc = admin_services
        found = await svc.public_prefixes.list_prefixes(include_unpublished=include_unpublished)
        delivery = prefix_delivery
        return [_view(info, delivery) for info in found]

    @get("/{prefix_id:str}")
    async def get_prefix(
        self,
        request: AdminRequest,
        admin_services: NamedDependency[AdminServices],
        prefix_delivery: NamedDependency[PrefixDelivery | None],
        prefix_id: FromPath[str],
    ) -> PublicPrefix:
        info = await admin_services.public_prefixes.get(prefix_id)
        return _view(info, prefix_delivery)

    @delete("/{prefix_id:str}", status_code=HTTP_200_OK)
    async def unpublish(
        self,
        request: AdminRequest,
        admin_services: NamedDependency[AdminServices],
        prefix_delivery: NamedDependency[PrefixDelivery | None],
        prefix_id: FromPath[str],
    ) -> PublicPrefix:
        svc = admin_services
        info = await svc.public_prefixes.unpublish(prefix_id, actor=actor_of(request))
        delivery = prefix_delivery
        await _deliver(delivery)
        return _view(info, delivery)
