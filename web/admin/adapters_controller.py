"""Admin routes for LoRA adapters: register a PEFT folder on this server for one tenant or for
all, on one of the served models, list, read, remove (stored in SQL, audited). Tenants then name
an adapter in ``model``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
from litestar import Controller, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody
from litestar.status_codes import HTTP_200_OK, HTTP_201_CREATED

from engine.lora.adapter import AdapterError, read_adapter_config
from tenants.errors import NotFoundError
from tenants.lora_adapters import LoraAdapterInfo, LoraAdapterService
from web.admin.context import database
from web.admin.tenants_controller import AdminRequest, actor_of
from web.ops.errors import ApiError


class LoraAdapterCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str  # what requests put in ``model``
    path: str  # the adapter's folder on this server (adapter_config.json + safetensors)
    tenant_id: str | None = None  # None: every tenant may use it
    base_model: str | None = None  # the served model it rides on; None: the first served model


def _service(request: AdminRequest) -> LoraAdapterService:
    return LoraAdapterService(database(request))


def _base_model(data: LoraAdapterCreate, served_models: Any) -> str | None:
    """The served model's own name for ``base_model`` (an alias resolved); 400 for a model
    this server does not serve. Unchecked where the server knows no served models."""
    if data.base_model is None or served_models is None:
        return data.base_model
    runtime = served_models.runtime_for(data.base_model)
    if runtime is None:
        served = ", ".join(f"`{r.name}`" for r in served_models.runtimes)
        raise ApiError(400, f"`{data.base_model[:128]}` is not a model this server serves "
                       f"(it serves {served}).", code="invalid_request",
                       param="base_model")  # fmt: skip
    return str(runtime.name)


def _check_folder(data: LoraAdapterCreate, served_models: Any, server_role: str) -> None:
    """Refuse a folder this server cannot serve now (400), and a name a served model has (409)."""
    if served_models is not None and served_models.runtime_for(data.name) is not None:
        raise ApiError(409, f"`{data.name}` is a served model's name.", code="conflict",
                       param="name")  # fmt: skip
    folder = Path(data.path)
    if not folder.is_absolute():
        raise ApiError(400, "path must be an absolute folder path", code="invalid_request",
                       param="path")  # fmt: skip
    if server_role == "gateway":
        return  # the folder is on the engines' disks; each checks it when a request names it
    try:
        read_adapter_config(folder)
    except AdapterError as exc:
        raise ApiError(400, str(exc), code="invalid_adapter", param="path") from None
    if not (folder / "adapter_model.safetensors").is_file():
        raise ApiError(400, f"{folder} has no adapter_model.safetensors", code="invalid_adapter",
                       param="path")  # fmt: skip


class LoraAdaptersController(Controller):
    path = "/lora-adapters"
    tags = ["admin"]  # noqa: RUF012 - Litestar reads this class attribute

    @post("/", status_code=HTTP_201_CREATED)
    async def register(
        self,
        request: AdminRequest,
        data: JSONBody[LoraAdapterCreate],
        served_models: NamedDependency[Any],
        server_role: NamedDependency[str],
    ) -> LoraAdapterInfo:
        service = _service(request)
        base_model = _base_model(data, served_models)
        _check_folder(data, served_models, server_role)
        return await service.register(
            data.name, data.path, data.tenant_id, base_model=base_model, actor=actor_of(request)
        )

    @get("/")
    async def list_adapters(
        self, request: AdminRequest, tenant_id: FromQuery[str | None] = None
    ) -> list[LoraAdapterInfo]:
        """Every adapter, or (with ``tenant_id``) those that tenant may use."""
        return await _service(request).list_adapters(tenant_id)

    @get("/{adapter_id:str}")
    async def get_adapter(
        self, request: AdminRequest, adapter_id: FromPath[str]
    ) -> LoraAdapterInfo:
        for adapter in await _service(request).list_adapters():
            if adapter.id == adapter_id:
                return adapter
        raise NotFoundError(f"no adapter {adapter_id[:64]!r}")

    @delete("/{adapter_id:str}", status_code=HTTP_200_OK)
    async def remove(self, request: AdminRequest, adapter_id: FromPath[str]) -> LoraAdapterInfo:
        return await _service(request).remove(adapter_id, actor=actor_of(request))
