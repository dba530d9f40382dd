"""An async OpenAI-compatible load generator: streaming /v1/completions over httpx, loopback only.

Arrivals at a fixed concurrency (closed loop), or at a Poisson rate or given times (open loop);
every run is bounded by its request list and a deadline. Each request becomes a
``RequestRecord`` with chunk times.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx

from bench.metrics import RequestRecord

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
Item = TypeVar("Item")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    tenant: str
    prompt: str
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Target:
    """A server to load: its base URL, model id, per-tenant keys and extra body fields."""

    base_url: str
    model: str
    keys: dict[str, str] = field(default_factory=dict)  # tenant -> API key (none: no header)
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        host = urlsplit(self.base_url).hostname
        if host not in LOOPBACK_HOSTS:
            raise ValueError(f"the load generator only targets loopback, not {host!r}")


def _body(target: Target, spec: RequestSpec) -> dict[str, Any]:
    return {
        "model": target.model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **target.extra_body,
    }


def _apply_event(
    record: RequestRecord, data: dict[str, Any], now: float, texts: list[str] | None
) -> None:
    choices = data.get("choices") or []
    text = None
    if choices:  # a completion's text, or a chat completion's content delta
        text = choices[0].get("text") or (choices[0].get("delta") or {}).get("content")
    if text:
        record.token_times.append(now)
        if texts is not None:
            texts.append(text)
    usage = data.get("usage")
    if usage:
        record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        record.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        record.cached_tokens = int(details.get("cached_tokens") or 0)


async def send(
    client: httpx.AsyncClient,
    target: Target,
    spec: RequestSpec,
    texts: list[str] | None = None,
    stop_at: float = math.inf,
) -> RequestRecord:
    """One streamed completion; errors are recorded, never raised. ``texts`` collects the text.
    A request still running at ``stop_at`` (``time.perf_counter()`` seconds) is cut off there and
    recorded as an error, with the tokens that had arrived."""
    body = _body(target, spec)
    return await stream_request(
        client, target, spec.tenant, "/v1/completions", body, texts, stop_at
    )


async def stream_request(
    client: httpx.AsyncClient,
    target: Target,
    tenant: str,
    path: str,
    body: dict[str, Any],
    texts: list[str] | None = None,
    stop_at: float = math.inf,
) -> RequestRecord:
    """One streamed request of ``body`` to ``path`` (completions or chat completions) as
    ``tenant``; recorded as ``send`` records it."""
    headers = {}
    key = target.keys.get(tenant)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    record = RequestRecord(tenant, time.perf_counter())
    url = target.base_url.rstrip("/") + path
    remaining = stop_at - time.perf_counter()
    try:
        async with (
            asyncio.timeout(None if math.isinf(remaining) else max(remaining, 0.0)),
            client.stream("POST", url, json=body, headers=headers) as resp,
        ):
            if resp.status_code != 200:
                await resp.aread()
                record.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    _apply_event(record, json.loads(payload), time.perf_counter(), texts)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    except TimeoutError:
        record.error = "deadline: cut off when the run's time ran out"
    record.done_at = time.perf_counter()
    if record.error is None and not record.completion_tokens:
        record.completion_tokens = len(record.token_times)
    return record


def client_for(timeout_s: float, limit: int) -> httpx.AsyncClient:
    """An HTTP client for ``limit`` requests at once, none slower than ``timeout_s``."""
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, trust_env=False)


async def run_closed_loop(
    target: Target, specs: Sequence[RequestSpec], concurrency: int, deadline_s: float = 600.0
) -> list[RequestRecord]:
    """Keep ``concurrency`` requests in flight until the list is done or ``deadline_s`` passes;
    requests still running then are cut off and recorded as errors."""

    async def one(
        client: httpx.AsyncClient, spec: RequestSpec, stop_at: float
    ) -> list[RequestRecord]:
        return [await send(client, target, spec, stop_at=stop_at)]

    return await run_workers(specs, one, concurrency, deadline_s)


async def run_workers(
    items: Sequence[Item],
    handle: Callable[[httpx.AsyncClient, Item, float], Awaitable[list[RequestRecord]]],
    concurrency: int,
    deadline_s: float,
) -> list[RequestRecord]:
    """``concurrency`` workers take ``items`` in order, each handled to its records by
    ``handle(client, item, stop_at)``, until the list is done or ``deadline_s`` passes (no item
    starts after that, and ``handle`` cuts off what runs at ``stop_at``)."""
    queue: asyncio.Queue[Item] = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    records: list[RequestRecord] = []
    stop_at = time.perf_counter() + deadline_s
    async with client_for(deadline_s, concurrency) as client:

        async def worker() -> None:
            while not queue.empty() and time.perf_counter() < stop_at:
                records.extend(await handle(client, queue.get_nowait(), stop_at))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


def poisson_offsets(rate: float, duration_s: float, seed: int) -> list[float]:
    """Arrival times in ``[0, duration_s)`` of a Poisson process of ``rate`` per second: gaps
    drawn from ``random.Random(seed)``, so a seed gives the same schedule on every run."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    rng = random.Random(seed)
    out: list[float] = []
    at = rng.expovariate(rate)
    while at < duration_s:
        out.append(at)
        at += rng.expovariate(rate)
    return out


async def run_scheduled(
    items: Sequence[Item],
    offsets: Sequence[float],
    handle: Callable[[httpx.AsyncClient, Item, float], Coroutine[Any, Any, list[RequestRecord]]],
    deadline_s: float,
    max_connections: int = 256,
) -> list[RequestRecord]:
    """Start ``handle(client, item, stop_at)`` for each item at its offset (ascending seconds
    from the start), whatever is still running: an open loop. Nothing starts after, and
    ``handle`` cuts off what runs at, ``deadline_s``. Past ``max_connections`` at once a request
    waits for a connection, on its own clock. Records come in the items' order."""
    if len(items) != len(offsets):
        raise ValueError("one offset per item")
    async with client_for(deadline_s, max_connections) as client:
        start = time.perf_counter()  # once the client is built: the schedule's own time
        stop_at = start + deadline_s
        tasks: list[asyncio.Task[list[RequestRecord]]] = []
        for item, offset in zip(items, offsets, strict=True):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if time.perf_counter() >= stop_at:
                break
            tasks.append(asyncio.create_task(handle(client, item, stop_at)))
        runs = await asyncio.gather(*tasks)
    return [record for records in runs for record in records]


async def run_poisson(
    target: Target,
    specs: Sequence[RequestSpec],
    rate: float,
    seed: int = 0,
    deadline_s: float = 600.0,
    max_in_flight: int = 256,
) -> list[RequestRecord]:
    """Send at exponential gaps of mean ``1 / rate`` seconds, at most ``max_in_flight`` at once."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    rng = random.Random(seed)
    gate = asyncio.Semaphore(max_in_flight)
    stop_at = time.perf_counter() + deadline_s
    async with client_for(deadline_s, max_in_flight) as client:

        async def one(spec: RequestSpec) -> RequestRecord:
            async with gate:
                return await send(client, target, spec, stop_at=stop_at)

        tasks = []
        for spec in specs:
            if time.perf_counter() >= stop_at:
                break
            tasks.append(asyncio.create_task(one(spec)))
            await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))


async def run_per_tenant(
    target: Target,
    specs_by_tenant: Mapping[str, Sequence[RequestSpec]],
    concurrency_by_tenant: Mapping[str, int],
    deadline_s: float = 600.0,
) -> list[RequestRecord]:
    """One closed loop per tenant, all at once (e.g. one tenant flooding the others)."""
    runs = [
        run_closed_loop(target, specs, concurrency_by_tenant[tenant], deadline_s)
        for tenant, specs in specs_by_tenant.items()
    ]
    return [record for records in await asyncio.gather(*runs) for record in records]


async def run_chat_sessions(
    target: Target,
    sessions: Sequence[tuple[str, Sequence[str]]],
    max_tokens: int,
    deadline_s: float = 600.0,
) -> list[RequestRecord]:
    """Each (tenant, messages) session sends its turns in order, the history growing each turn."""
    stop_at = time.perf_counter() + deadline_s
    async with client_for(deadline_s, max(len(sessions), 1)) as client:

        async def session(tenant: str, messages: Sequence[str]) -> list[RequestRecord]:
            history = ""
            records = []
            for message in messages:
                if time.perf_counter() >= stop_at:
                    break
                prompt = history + message
                texts: list[str] = []
                spec = RequestSpec(tenant, prompt, max_tokens)
                records.append(await send(client, target, spec, texts, stop_at=stop_at))
                history = prompt + "".join(texts)
            return records

        runs = await asyncio.gather(*(session(t, m) for t, m in sessions))
    return [record for records in runs for record in records]
