"""The engines behind a gateway's engine URL: found from the router's worker list (or the URL
itself), polled for their snapshots, and summed for the gateway's engine view."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import msgspec

from engine.stats import EngineSnapshot, EngineStats
from radix_cache.stats import NamespaceSnapshot
from web.engine_api.client import HttpEngineClient
from web.engine_api.fleet import Fleet, merge_snapshots

TOKEN = "engine-token"


def snapshot(running: int, total: int, cached: int, hits: int) -> EngineSnapshot:
    cache = NamespaceSnapshot("tenant:a", cached, 0, None, 1.0, None, 1, 10, hits, 0, 0)
    return EngineSnapshot(
        running_by_tenant={"a": running},
        num_pages_total=total,
        num_pages_free=total - cached,
        num_pages_available=total,
        page_size=16,
        counters=EngineStats(num_cached_tokens=hits, num_prefill_tokens=10 - hits),
        cache_by_namespace={"tenant:a": cache},
    )


def test_merge_sums_counts_pages_and_namespaces() -> None:
    merged = merge_snapshots([snapshot(1, 100, 5, 4), snapshot(2, 50, 3, 2)])
    assert merged.running_by_tenant == {"a": 3}
    assert (merged.num_pages_total, merged.num_pages_free, merged.page_size) == (150, 142, 16)
    assert merged.counters.num_cached_tokens == 6
    cache = merged.cache_by_namespace["tenant:a"]
    assert (cache.resident_pages, cache.hit_tokens, cache.queried_tokens) == (8, 6, 20)
    assert merge_snapshots([]) == EngineSnapshot()


def fleet(handler: Any) -> Fleet:
    client = HttpEngineClient(
        "http://router.test", TOKEN, tokenizer=None,  # type: ignore[arg-type]
        model="m", transport=httpx.MockTransport(handler),
    )  # fmt: skip
    return Fleet(client)


def test_workers_come_from_the_router_and_a_dead_one_is_listed_unhealthy() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == f"Bearer {TOKEN}"
        if request.url.path == "/workers":
            urls = ["http://e2.test", "http://e1.test"]
            return httpx.Response(200, json={"workers": [{"url": u} for u in urls]})
        if request.url.host == "e1.test":
            return httpx.Response(200, content=msgspec.json.encode(snapshot(1, 100, 5, 4)))
        raise httpx.ConnectError("refused", request=request)

    views = asyncio.run(fleet(handler).poll())
    assert [(v.url, v.healthy) for v in views] == [
        ("http://e1.test", True),
        ("http://e2.test", False),
    ]
    assert views[0].snapshot.num_pages_total == 100


def test_an_engine_url_without_a_worker_list_is_one_engine() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/workers":
            return httpx.Response(404, json={})
        return httpx.Response(200, content=msgspec.json.encode(snapshot(2, 64, 1, 1)))

    found = fleet(handler)
    views = asyncio.run(found.poll())
    assert [(v.url, v.healthy) for v in views] == [("http://router.test", True)]
    assert found.client.stats().num_running == 2


def test_the_model_card_comes_from_an_engine_behind_the_router() -> None:
    from web.engine_api.gateway import describe

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/workers":
            return httpx.Response(200, json={"workers": [{"url": "http://e1.test"}]})
        if request.url.host == "e1.test":
            card = {"id": "m", "max_model_len": 1024, "kv_capacity_tokens": 4096}
            return httpx.Response(200, json={"data": [card]})
        return httpx.Response(200, json={"data": [{"id": "m"}]})  # the router's own list

    async def run() -> dict[str, Any] | None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await describe(http, "http://router.test", TOKEN)

    assert asyncio.run(run()) == {"id": "m", "max_model_len": 1024, "kv_capacity_tokens": 4096}


def test_summed_counters_never_go_back_as_engines_restart_miss_polls_or_leave() -> None:
    """Two engines: one misses a poll, comes back, restarts (counting anew), then both go."""
    reports: dict[str, int | None] = {"e1": 10, "e2": 20}  # prefill tokens; None: no answer

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/workers":
            return httpx.Response(
                200, json={"workers": [{"url": "http://e1.test"}, {"url": "http://e2.test"}]}
            )
        tokens = reports[str(request.url.host).removesuffix(".test")]
        if tokens is None:
            return httpx.Response(503)
        counters = EngineStats(num_prefill_tokens=tokens)
        return httpx.Response(200, content=msgspec.json.encode(EngineSnapshot(counters=counters)))

    polled = fleet(handler)
    polled.client.fleet = polled  # as the gateway role wires it

    def total() -> tuple[int, bool]:
        asyncio.run(polled.poll())
        return polled.client.stats().counters.num_prefill_tokens, polled.answering

    assert total() == (30, True)
    reports["e2"] = None  # a missed poll: what it counted stays
    assert total() == (30, True)
    reports.update(e1=15, e2=25)  # back, with five more each
    assert total() == (40, True)
    reports["e2"] = 3  # restarted: three new ones
    assert total() == (43, True)
    reports.update(e1=None, e2=None)  # none answers: not running, and nothing lost
    assert total() == (43, False)
    assert not polled.client.is_running
