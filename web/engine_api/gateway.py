"""The gateway role (`atrium serve --role gateway`): the tenant-facing app with no model loaded.

It keeps the tokenizer (prompt lengths, chat templates) and sends generation to ``engine_url``
(a router or one engine) over HTTP. The served name, context length and KV capacity come from
an engine's ``/v1/models`` (the first of the router's workers, or the URL itself): at start,
then every few seconds in the background until one answers. Meanwhile the local model's name
is served and the engines refuse what does not fit (a 400 that costs the tenant nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import msgspec
import structlog
from litestar import Litestar

from engine.model.loader import load_tokenizer
from web.engine_api.client import HttpEngineClient
from web.engine_api.fleet import Fleet
from web.engine_api.local import engine_numbers
from web.openai.generation import ModelRuntime
from web.settings import Settings

log = structlog.get_logger("atrium.gateway")
UNKNOWN_CONTEXT = 1 << 20  # until an engine says: the engine refuses a prompt that is too long
DESCRIBE_TIMEOUT_S = 5.0
DESCRIBE_RETRY_S = 2.0


def _first_card(answer: httpx.Response) -> dict[str, Any] | None:
    cards = answer.json().get("data") if answer.status_code == 200 else None
    return cards[0] if isinstance(cards, list) and cards and isinstance(cards[0], dict) else None


async def describe(client: httpx.AsyncClient, url: str, token: str) -> dict[str, Any] | None:
    """The model card of an engine behind ``url``: a router's first worker (a router's own
    list lacks the context length), or ``url`` itself; None when none answers."""
    headers = {"Authorization": f"Bearer {token}"}
    targets = []
    with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError, KeyError, TypeError):
        workers = await client.get(f"{url}/workers", headers=headers)
        if workers.status_code == 200:
            targets = [str(w["url"]) for w in workers.json()["workers"] if isinstance(w, dict)]
    for target in [*targets, url]:
        with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError):
            card = _first_card(await client.get(f"{target}/v1/models", headers=headers))
            if card is not None:
                return card
    return None


def apply_card(runtime: ModelRuntime, client: HttpEngineClient, card: dict[str, Any]) -> None:
    """Serve under the engine's name and limits (the name a router routes by)."""
    name = str(card.get("id") or runtime.name)
    client.model = name
    if name != runtime.name:
        runtime.aliases = tuple(a for a in (*runtime.aliases, runtime.name) if a != name)
        runtime.name = name
    length = card.get("max_model_len")
    if isinstance(length, int) and length > 1:
        runtime.max_model_len = length
    capacity = card.get("kv_capacity_tokens")
    runtime.kv_capacity_tokens = capacity if isinstance(capacity, int) else None
    log.info("engine_described", model=name, max_model_len=runtime.max_model_len)


async def follow_engine(runtime: ModelRuntime, client: HttpEngineClient) -> None:
    """Describe the engines until one answers (at start, or once one comes up)."""
    async with httpx.AsyncClient(timeout=DESCRIBE_TIMEOUT_S) as http:
        while True:
            card = await describe(http, client.url, client.token)
            if card is not None:
                apply_card(runtime, client, card)
                return
            await asyncio.sleep(DESCRIBE_RETRY_S)


def remote_runtime(settings: Settings) -> tuple[ModelRuntime, HttpEngineClient]:
    """The model as the gateway serves it: local tokenizer, engine over HTTP."""
    settings = settings.single_model()
    tokenizer, name = load_tokenizer(settings.model)
    name = settings.served_model_name or name
    client = HttpEngineClient(
        (settings.engine_url or "").rstrip("/"),
        settings.engine_token or "",
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
        max_model_len=settings.max_model_len or UNKNOWN_CONTEXT,
        aliases=("default",) if settings.model == "default" else (),
        stats=lambda: engine_numbers(client.stats()),
    )
    return runtime, client


def remote_runtimes(settings: Settings) -> list[tuple[ModelRuntime, HttpEngineClient]]:
    """Each served model with its own engine pool: ``--model NAME=PATH`` (the tokenizer) and
    ``--engine-url NAME=URL`` (its router or engine); one plain URL serves the one model."""
    urls = dict(settings.engine_urls)
    if None in urls:
        return [remote_runtime(settings)]
    return [
        remote_runtime(
            msgspec.structs.replace(
                settings, model=path, served_model_name=name, engine_url=urls[name]
            )
        )
        for name, path in settings.model_specs
    ]


def follow_engines(app: Litestar, remotes: list[tuple[ModelRuntime, HttpEngineClient]]) -> None:
    """Start ``remotes``' clients with ``app`` and follow each engine's card; stop them with it."""
    tasks: list[asyncio.Task[None]] = []

    async def start() -> None:
        following: list[tuple[asyncio.Task[None], HttpEngineClient]] = []
        for runtime, client in remotes:
            client.start()
            client.fleet.start()
            task = asyncio.create_task(follow_engine(runtime, client))
            tasks.append(task)
            following.append((task, client))
        # Wait briefly so that the first requests already see the engines' names and limits.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.shield(asyncio.gather(*(task for task, _ in following))),
                DESCRIBE_TIMEOUT_S,
            )
        for task, client in following:
            if not task.done():
                log.warning("engine_not_answering", url=client.url)

    async def stop() -> None:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for _, client in remotes:
            fleet: Fleet = client.fleet
            await fleet.stop()
            await client.shutdown()

    app.on_startup.append(start)
    app.on_shutdown.append(stop)
