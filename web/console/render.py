"""Renders console pages with Jinja: one environment per app, filters for readable numbers."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
from jinja2 import Environment, FileSystemLoader, select_autoescape
from litestar import Request, Response
from litestar.enums import MediaType

TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "templates"
ENV_STATE = "console_templates"
ROOT = "/admin/"
API = "/admin/v1"
NAV = (
    ("", "Overview"),
    ("live", "Live"),
    ("engines", "Engines"),
    ("tenants", "Tenants"),
    ("keys", "Keys"),
    ("batches", "Batches"),
    ("prefixes", "Public prefixes"),
    ("usage", "Usage"),
    ("billing", "Billing"),
    ("audit", "Audit"),
)


def num(value: float | int | None) -> str:
    """Thousands separators; at most two decimals."""
    if value is None:
        return "—"
    if isinstance(value, int) or float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.2f}"


def limit(value: float | int | None, unit: str = "") -> str:
    if value is None:
        return "unlimited"
    return f"{num(value)} {unit}".strip()


def share(value: float | None) -> str:
    return "unlimited" if value is None else f"{value * 100:.4g} %"


def money(micros: int | None) -> str:
    """Integer micro-units as a decimal amount (trailing zeros trimmed, at least cents)."""
    if micros is None:
        return "—"
    whole, frac = divmod(abs(micros), 1_000_000)
    digits = f"{frac:06d}".rstrip("0").ljust(2, "0")
    return f"{'-' if micros < 0 else ''}{whole:,}.{digits}"


def decimal_money(micros: int) -> str:
    """Micro-units as a plain decimal an ``<input type=number>`` accepts (``1234.5``)."""
    whole, frac = divmod(abs(micros), 1_000_000)
    digits = f"{frac:06d}".rstrip("0")
    return f"{'-' if micros < 0 else ''}{whole}{'.' + digits if digits else ''}"


def when(value: datetime | None) -> str:
    return "—" if value is None else value.strftime("%Y-%m-%d %H:%M UTC")


def compact(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    return json.dumps(msgspec.to_builtins(value), sort_keys=True, separators=(",", ":"))


def _flat(snapshot: Any, prefix: str = "") -> dict[str, Any]:
    """A snapshot's fields with nested objects flattened to dotted names (``quotas.x``)."""
    flat: dict[str, Any] = {}
    for key, value in (msgspec.to_builtins(snapshot) or {}).items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def changes(before: Any, after: Any) -> list[tuple[str, str, str]]:
    """``(field, was, now)`` for each field an audited change set, changed or cleared."""
    old, new = _flat(before), _flat(after)
    return [
        (name, compact(old.get(name)), compact(new.get(name)))
        for name in sorted(old.keys() | new.keys())
        if old.get(name) != new.get(name)
    ]


def static(path: str) -> str:
    return f"{ROOT}static/{path}"


def build_environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(TEMPLATES_DIR),
        autoescape=select_autoescape(["html"]),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        num=num,
        limit=limit,
        share=share,
        money=money,
        decimal_money=decimal_money,
        when=when,
        compact=compact,
        changes=changes,
    )
    env.globals.update(static=static, root=ROOT, api=API, nav=NAV)
    return env


def render(
    request: Request[Any, Any, Any], template: str, status_code: int = 200, **context: Any
) -> Response[str]:
    """An HTML response of ``console/<template>``; the environment is built once per app."""
    env = request.app.state.get(ENV_STATE)
    if not isinstance(env, Environment):
        env = build_environment()
        request.app.state[ENV_STATE] = env
    html = env.get_template(f"console/{template}").render(**context)
    return Response(
        content=html,
        status_code=status_code,
        media_type=MediaType.HTML,
        headers={"Cache-Control": "no-store", "X-Frame-Options": "DENY"},
    )
