"""The engines behind a gateway's engine URL, polled for the admin API's engine view.

The engines are found from the router's worker list (``GET /workers``, smg's control API, with
the engine token); when the URL answers no such list it is taken to be one engine itself. Each
engine's snapshot comes from its ``/atrium/v1/state``; the sum of all of them is what the
gateway's ``stats()`` returns, and each one is listed on its own.

The engines' counters are cumulative since each one started, so their sum would go back when an
engine restarts, misses a poll or leaves. The fleet counts each engine on its own instead (what
it reported before, and what it counted of its earlier lives): the summed counters it hands on
never go down, and a restart's or a missed poll's tokens are counted once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

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


COUNTERS = tuple(field.name for field in fields(EngineStats))


def _sum_stats(a: EngineStats, b: EngineStats) -> EngineStats:
    return EngineStats(**{name: getattr(a, name) + getattr(b, name) for name in COUNTERS})


class CounterBase:
    """Per engine, its counters as reported last and as counted in all (its earlier lives
    included), so that their sum never goes down."""

    def __init__(self) -> None:
        self._reported: dict[str, EngineStats] = {}
        self._counted: dict[str, EngineStats] = {}

    def count(self, url: str, now: EngineStats) -> None:
        """Count what the engine at ``url`` did since its last report; counters below that
        report mean it restarted, and everything it reports now is new."""
        before = self._reported.get(url)
        if before is None or any(getattr(now, n) < getattr(before, n) for n in COUNTERS):
            before = EngineStats()
        counted = self._counted.get(url, EngineStats())
        self._counted[url] = EngineStats(
            **{n: getattr(counted, n) + getattr(now, n) - getattr(before, n) for n in COUNTERS}
        )
        self._reported[url] = now

    def total(self) -> EngineStats:
        """Everything counted, of every engine ever seen."""
        total = EngineStats()
        for counted in self._counted.values():
            total = _sum_stats(total, counted)
        return total


def merge_snapshots(snapshots: Sequence[EngineSnapshot]) -> EngineSnapshot:
    """The engines' snapshots summed (counts, pages, counters, per-namespace numbers)."""
    merged = EngineSnapshot()
    counters = EngineStats()
    caches: dict[str, NamespaceSnapshot] = {}
    running: dict[str, int] = {}
    waiting: dict[str, int] = {}
    waits: dict[str, float] = {}
    total = free = available = page_size = 0
    for snap in snapshots:
        running = _add_counts(running, snap.running_by_tenant)
        waiting = _add_counts(waiting, snap.waiting_by_tenant)
        for tenant, wait in snap.queue_wait_by_tenant.items():
            waits[tenant] = max(wait, waits.get(tenant, 0.0))
        total += snap.num_pages_total
        free += snap.num_pages_free
        available += snap.num_pages_available
        page_size = page_size or snap.page_size
        counters = _sum_stats(counters, snap.counters)
        for namespace, numbers in snap.cache_by_namespace.items():
            known = caches.get(namespace)
            caches[namespace] = numbers if known is None else _add_namespace(known, numbers)
    if not snapshots:
        return merged
    return EngineSnapshot(
        running_by_tenant=running,
        waiting_by_tenant=waiting,
        queue_wait_by_tenant=waits,
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
        self._counters = CounterBase()
        self._task: asyncio.Task[None] | None = None

    @property
    def answering(self) -> bool:
        """Whether an engine answered the last poll (the gateway is ready only then)."""
        return any(view.healthy for view in self.views)

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
        healthy = [view for view in self.views if view.healthy]
        for view in healthy:
            self._counters.count(view.url, view.snapshot.counters)
        merged = merge_snapshots([view.snapshot for view in healthy])
        self.client.set_snapshot(replace(merged, counters=self._counters.total()))
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
