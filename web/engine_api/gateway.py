"""The gateway role (`atrium serve --role gateway`): the tenant-facing app with no model loaded.

It keeps the tokenizer (prompt lengths, chat templates) and sends generation to ``engine_url``
(a router or one engine) over HTTP. The served name, context length and KV capacity come from
the engine's ``/v1/models`` when it answers at start; otherwise the local model's name is used
and the engines refuse what does not fit (a 400 that costs the tenant nothing).
"""

from __future__ import annotations

from typing import Any

import httpx
import structlog
from litestar import Litestar

from web.engine_api.client import HttpEngineClient
from web.engine_api.fleet import Fleet
from web.service_generation import ModelRuntime
from web.settings import Settings

log = structlog.get_logger("atrium.gateway")
UNKNOWN_CONTEXT = 1 << 20  # until an engine says: the engine refuses a prompt that is too long
DESCRIBE_TIMEOUT_S = 5.0


def describe(url: str, token: str) -> dict[str, Any] | None:
    """The first model card ``url`` lists, or None when it does not answer one."""
    try:
        answer = httpx.get(
            f"{url}/v1/models",
            headers={"Authorization": f"Bearer {token}"},
            timeout=DESCRIBE_TIMEOUT_S,
        )
        cards = answer.json().get("data") if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return cards[0] if isinstance(cards, list) and cards and isinstance(cards[0], dict) else None


def remote_runtime(settings: Settings) -> tuple[ModelRuntime, HttpEngineClient]:
    """The model as the gateway serves it: local tokenizer, engine over HTTP."""
    from engine.model.loader import load_tokenizer
    from web.app import engine_numbers

    tokenizer, name = load_tokenizer(settings.model)
    url = (settings.engine_url or "").rstrip("/")
    token = settings.engine_token or ""
    card = describe(url, token)
    max_model_len = settings.max_model_len or UNKNOWN_CONTEXT
    capacity = None
    if card is not None:
        name = str(card.get("id") or name)
        max_model_len = int(card.get("max_model_len") or max_model_len)
        capacity = card.get("kv_capacity_tokens")
    else:
        log.warning("engine_not_answering", url=url)
    client = HttpEngineClient(
        url,
        token,
        tokenizer,
        name,
        connect_timeout_s=settings.engine_connect_timeout_s,
        read_timeout_s=settings.engine_read_timeout_s,
    )
    client.fleet = Fleet(client)
    runtime = ModelRuntime(
        name=name,
        engine=client,
        tokenizer=tokenizer,
        max_model_len=max_model_len,
        aliases=("default",) if settings.model == "default" else (),
        stats=lambda: engine_numbers(client.stats()),
        kv_capacity_tokens=capacity if isinstance(capacity, int) else None,
    )
    return runtime, client


def create_gateway_app(settings: Settings) -> Litestar:
    """The gateway app of all-in-one (``web.app.create_app``) around a remote engine."""
    from web.app import create_app

    runtime, client = remote_runtime(settings)
    app = create_app(settings, engine=runtime)
    fleet: Fleet = client.fleet

    async def start() -> None:
        client.start()
        fleet.start()

    async def stop() -> None:
        await fleet.stop()
        await client.shutdown()

    app.on_startup.append(start)
    app.on_shutdown.append(stop)
    return app
