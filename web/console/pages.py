"""The console's pages: server-rendered from the tenant services, signed-in operators only."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any

from litestar import Request, Response, get
from litestar.params import FromQuery
from litestar.response import Redirect

from web.admin.context import services
from web.admin.session import csrf_token, current_session
from web.admin.window import resolve_window
from web.console.render import ROOT, render

ConsoleRequest = Request[Any, Any, Any]


async def page(
    request: ConsoleRequest, template: str, slug: str, title: str, **context: Any
) -> Response[Any]:
    """The page for a signed-in operator, else back to the sign-in form."""
    session = await current_session(request)
    if session is None:
        return Redirect(ROOT, status_code=303)
    token = csrf_token(session)
    return render(request, template, page=slug, title=title, csrf_token=token, **context)


def _day(value: date) -> datetime:
    return datetime(value.year, value.month, value.day, tzinfo=UTC)


@get("/")
async def overview(request: ConsoleRequest) -> Response[Any]:
    if await current_session(request) is None:
        return render(request, "signin.html", error=None)
    return await page(request, "overview.html", "", "Overview")


@get("/live")
async def live_page(request: ConsoleRequest) -> Response[Any]:
    return await page(request, "live.html", "live", "Live")


@get("/engines")
async def engines_page(request: ConsoleRequest) -> Response[Any]:
    return await page(request, "engines.html", "engines", "Engines")


@get("/prefixes")
async def prefixes_page(request: ConsoleRequest) -> Response[Any]:
    return await page(request, "prefixes.html", "prefixes", "Public prefixes")


@get("/usage")
async def usage_page(
    request: ConsoleRequest, tenant_id: FromQuery[str | None] = None
) -> Response[Any]:
    if await current_session(request) is None:
        return Redirect(ROOT, status_code=303)
    tenants = await (await services(request)).tenants.list_tenants(include_deleted=True)
    return await page(
        request, "usage.html", "usage", "Usage", tenants=tenants, selected=tenant_id or ""
    )


@get("/billing")
async def billing_page(request: ConsoleRequest) -> Response[Any]:
    if await current_session(request) is None:
        return Redirect(ROOT, status_code=303)
    today = datetime.now(UTC).date()
    prices = await (await services(request)).prices.list_prices()
    return await page(
        request,
        "billing.html",
        "billing",
        "Billing",
        prices=prices,
        default_model=request.app.state.get("model_name") or "",
        export_start=today.replace(day=1).isoformat(),
        export_end=(today + timedelta(days=1)).isoformat(),
    )


@get("/audit")
async def audit_page(
    request: ConsoleRequest,
    start: FromQuery[date | None] = None,
    end: FromQuery[date | None] = None,
) -> Response[Any]:
    if await current_session(request) is None:
        return Redirect(ROOT, status_code=303)
    end_day = end or datetime.now(UTC).date() + timedelta(days=1)
    start_day = start or end_day - timedelta(days=7)
    start_at, end_at = resolve_window(_day(start_day), _day(end_day))
    entries = await (await services(request)).audit.entries(start_at, end_at)
    return await page(
        request,
        "audit.html",
        "audit",
        "Audit",
        entries=entries,
        start=start_day.isoformat(),
        end=end_day.isoformat(),
    )
