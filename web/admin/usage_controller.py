"""Admin routes for usage buckets, the billing export (with its manifest) and prices."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from litestar import Response, get, put
from litestar.params import FromPath, FromQuery, JSONBody, QueryParameter

from tenants.records import (
    BillingManifest,
    ExportFormat,
    Granularity,
    PriceInfo,
    PriceSet,
    UsageBucket,
)
from web.admin.context import services
from web.admin.tenants_controller import AdminRequest, actor_of
from web.admin.window import as_utc, resolve_window
from web.ops.errors import bad_request

FormatParam = Annotated[ExportFormat, QueryParameter(name="format")]
MEDIA_TYPES = {"csv": "text/csv; charset=utf-8", "jsonl": "application/jsonl; charset=utf-8"}


@get("/usage", tags=["admin"])
async def usage(
    request: AdminRequest,
    tenant_id: FromQuery[str | None] = None,
    start: FromQuery[datetime | None] = None,
    end: FromQuery[datetime | None] = None,
    granularity: FromQuery[Granularity] = "hour",
) -> list[UsageBucket]:
    start_at, end_at = resolve_window(start, end)
    reports = (await services(request)).reports
    return await reports.usage(start_at, end_at, granularity, tenant_id=tenant_id or None)


def manifest_headers(manifest: BillingManifest, filename: str) -> dict[str, str]:
    currencies = ",".join(f"{c}:{m}" for c, m in sorted(manifest.cost_micros.items()))
    return {
        "Content-Disposition": f'attachment; filename="{filename}"',
        "X-Atrium-Manifest-Sha256": manifest.sha256,
        "X-Atrium-Row-Count": str(manifest.rows),
        "X-Atrium-Total-Requests": str(manifest.requests),
        "X-Atrium-Total-Prompt-Tokens": str(manifest.prompt_tokens),
        "X-Atrium-Total-Cached-Tokens": str(manifest.cached_tokens),
        "X-Atrium-Total-Completion-Tokens": str(manifest.completion_tokens),
        "X-Atrium-Total-Cost-Micros": currencies,
        "Cache-Control": "no-store",
    }


async def _export(
    request: AdminRequest, start: datetime, end: datetime, fmt: ExportFormat
) -> tuple[bytes, BillingManifest]:
    start_at, end_at = as_utc(start), as_utc(end)
    if end_at <= start_at:
        raise bad_request("end must be after start", "end")
    return await (await services(request)).billing.billing_export(start_at, end_at, fmt)


@get("/billing/export", tags=["admin"])
async def billing_export(
    request: AdminRequest,
    start: FromQuery[datetime],
    end: FromQuery[datetime],
    fmt: FormatParam = "csv",
) -> Response[bytes]:
    data, manifest = await _export(request, start, end, fmt)
    stamp = f"{manifest.start:%Y%m%dT%H%M%SZ}-{manifest.end:%Y%m%dT%H%M%SZ}"
    return Response(
        content=data,
        media_type=MEDIA_TYPES[fmt],
        headers=manifest_headers(manifest, f"atrium-billing-{stamp}.{fmt}"),
    )


@get("/billing/manifest", tags=["admin"])
async def billing_manifest(
    request: AdminRequest,
    start: FromQuery[datetime],
    end: FromQuery[datetime],
    fmt: FormatParam = "csv",
) -> BillingManifest:
    """The manifest the export of the same window and format carries (its digest and totals)."""
    return (await _export(request, start, end, fmt))[1]


@put("/prices/{model:path}", tags=["admin"])
async def set_price(
    request: AdminRequest, model: FromPath[str], data: JSONBody[PriceSet]
) -> PriceInfo:
    prices = (await services(request)).prices
    return await prices.set_price(model.lstrip("/"), data, actor=actor_of(request))


@get("/prices", tags=["admin"])
async def list_prices(request: AdminRequest) -> list[PriceInfo]:
    return await (await services(request)).prices.list_prices()


__all__ = ["billing_export", "billing_manifest", "list_prices", "set_price", "usage"]
