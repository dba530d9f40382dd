"""The engines behind a gateway's engine URL, polled for the admin API's engine view.

The engines are found from the router's worker list (``GET /workers``, smg's control API, with
the engine token); when the URL answers no such list it is taken to be one engine itself. Each
engine's snapshot comes from its ``/atrium/v1/state``; the sum of all of them is what the
gateway's ``stats()`` returns, and each one is listed on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, fields

import httpx
import msgspec
import structlog

from engine.stats import EngineSnapshot, EngineStats
from radix_cache.stats import NamespaceSnapshot
from web.engine_api.client import HttpEngineClient
from web.engine_api.wire import STATE_PATH

log = structlog.get_logger("atrium.engine_fleet")
POLL_INTERVAL_S = 2.0


@dataclass(frozen=True, slots=True)
class EngineView:
    """One engine as last polled: its URL, whether it answered, and its snapshot."""

    url: str
    healthy: bool
    snapshot: EngineSnapshot


def _add_counts(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {key: a.get(key, 0) + b.get(key, 0) for key in a.keys() | b.keys()}


def _add_namespace(a: NamespaceSnapshot, b: NamespaceSnapshot) -> NamespaceSnapshot:
    return a._replace(
        resident_pages=a.resident_pages + b.resident_pages,
        locked_pages=a.locked_pages + b.locked_pages,
        cap_pages=None if a.cap_pages is None else a.cap_pages + (b.cap_pages or 0),
        queries=a.queries + b.queries,
        queried_tokens=a.queried_tokens + b.queried_tokens,
        hit_tokens=a.hit_tokens + b.hit_tokens,
        public_hit_tokens=a.public_hit_tokens + b.public_hit_tokens,
        evicted_pages=a.evicted_pages + b.evicted_pages,
    )


def merge_snapshots(snapshots: Sequence[EngineSnapshot]) -> EngineSnapshot:
    """The engines' snapshots summed (counts, pages, counters, per-namespace numbers)."""
    merged = EngineSnapshot()
    counters = EngineStats()
    caches: dict[str, NamespaceSnapshot] = {}
    running: dict[str, int] = {}
    waiting: dict[str, int] = {}
    total = free = available = page_size = 0
    for snap in snapshots:
        running = _add_counts(running, snap.running_by_tenant)
        waiting = _add_counts(waiting, snap.waiting_by_tenant)
        total += snap.num_pages_total
        free += snap.num_pages_free
        available += snap.num_pages_available
        page_size = page_size or snap.page_size
        for field in fields(EngineStats):
            name = field.name
            setattr(counters, name, getattr(counters, name) + getattr(snap.counters, name))
        for namespace, numbers in snap.cache_by_namespace.items():
            known = caches.get(namespace)
            caches[namespace] = numbers if known is None else _add_namespace(known, numbers)
    if not snapshots:
        return merged
    return EngineSnapshot(
        running_by_tenant=running,
        waiting_by_tenant=waiting,
        num_pages_total=total,
        num_pages_free=free,
        num_pages_available=available,
        page_size=page_size,
        counters=counters,
        cache_by_namespace=caches,
    )


class Fleet:
    """Polls the engines behind ``client.url`` every ``interval_s`` while started."""

    def __init__(self, client: HttpEngineClient, interval_s: float = POLL_INTERVAL_S) -> None:
        self.client = client
        self.interval_s = interval_s
        self.views: list[EngineView] = []
        self._task: asyncio.Task[None] | None = None

    async def engine_urls(self) -> list[str]:
        """The router's workers, or the URL itself when it is not a router."""
        url = self.client.url
        with contextlib.suppress(httpx.HTTPError, ValueError):
            answer = await self.client.http.get(f"{url}/workers", headers=self.client.headers)
            if answer.status_code == 200:
                workers = answer.json().get("workers")
                if isinstance(workers, list):
                    return sorted(str(w["url"]) for w in workers if isinstance(w, dict))
        return [url]

    async def _view(self, url: str) -> EngineView:
        try:
            answer = await self.client.http.get(url + STATE_PATH, headers=self.client.headers)
            if answer.status_code == 200:
                snapshot = msgspec.json.decode(answer.content, type=EngineSnapshot)
                return EngineView(url, True, snapshot)
        except (httpx.HTTPError, msgspec.DecodeError):
            pass
        return EngineView(url, False, EngineSnapshot())

    async def poll(self) -> list[EngineView]:
        urls = await self.engine_urls()
        self.views = list(await asyncio.gather(*(self._view(url) for url in urls)))
        self.client.set_snapshot(merge_snapshots([v.snapshot for v in self.views if v.healthy]))
        return self.views

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception:  # a poll must never stop the next one
                log.exception("engine_poll_failed")
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
