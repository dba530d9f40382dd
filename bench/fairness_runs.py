"""The fairness benchmark's two runs against one server: weighted tenants, and a flooder.

Weighted: tenants of different weights each keep a fixed number of requests in flight, started
one after the other in a given order; once all are busy, the tokens each receives over the same
window are its service, compared with its weighted share. Flood: light tenants alone, then the
same light tenants beside one sending ten times as many; each light tenant's TTFT is compared.
"""

from __future__ import annotations

import asyncio
import random
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from bench.loadgen import RequestSpec, Target, run_closed_loop
from bench.metrics import RequestRecord, percentile
from bench.text_workloads import make_text


@dataclass(frozen=True, slots=True)
class Load:
    words: Sequence[str]
    prompt_len: int = 96  # words (about as many tokens) of fresh text per request
    output_len: int = 48


QUIET_S = 3.0  # seconds between a flood round's runs
# The weights runs' tenants, and their arrival orders by the first to come.
WEIGHTS = {"w1": 1.0, "w2": 2.0, "w4": 4.0}
ORDERS = {"w1": ("w1", "w2", "w4"), "w4": ("w4", "w2", "w1")}


def _specs(load: Load, tenant: str, count: int, seed: int) -> list[RequestSpec]:
    rng = random.Random(seed)
    return [
        RequestSpec(tenant, make_text(rng, load.words, load.prompt_len), load.output_len)
        for _ in range(count)
    ]


async def _poll_engine(
    base_url: str, admin_token: str, until: float, samples: list[dict[str, Any]]
) -> None:
    """Running and waiting requests per tenant, once a second (the admin API's engine view)."""
    headers = {"Authorization": f"Bearer {admin_token}"}
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
        while time.perf_counter() < until:
            try:
                body = (await client.get(base_url + "/admin/v1/engine", headers=headers)).json()
                samples.append(
                    {
                        t["tenant_name"]: {"running": t["running"], "waiting": t["waiting"]}
                        for t in body.get("tenants", [])
                    }
                )
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                pass
            await asyncio.sleep(1.0)


def run_specs(load: Load, order: Sequence[str], tenant: str, count: int) -> list[RequestSpec]:
    """A tenant's requests in the run of arrival ``order``: fresh prompts in every run. A tenant
    sending the prompts it sent in an earlier run on the same server would find them cached,
    pay a tenth of their cost and be given more requests for its weight."""
    return _specs(load, tenant, count, seed=zlib.crc32(f"{','.join(order)}:{tenant}".encode()))


def tokens_in(records: Sequence[RequestRecord], start: float, end: float) -> dict[str, int]:
    """Tokens each tenant received between ``start`` and ``end`` (client arrival times)."""
    out: dict[str, int] = {}
    for record in records:
        n = sum(1 for at in record.token_times if start <= at < end)
        out[record.tenant] = out.get(record.tenant, 0) + n
    return out


def weighted_shares(tokens: Mapping[str, float], weights: Mapping[str, float]) -> dict[str, float]:
    """Each tenant's share of the tokens over its weighted share (1.0: exactly its weight)."""
    total = sum(tokens.get(t, 0) for t in weights)
    weight_sum = sum(weights.values())
    if not total:
        return {t: 0.0 for t in weights}
    return {t: (tokens.get(t, 0) / total) / (w / weight_sum) for t, w in weights.items()}


async def weighted_run(
    target: Target,
    load: Load,
    weights: Mapping[str, float],
    order: Sequence[str],
    in_flight: int,
    stagger_s: float,
    warmup_s: float,
    window_s: float,
    admin_token: str,
) -> dict[str, Any]:
    """Start each tenant's closed loop ``stagger_s`` after the previous one (in ``order``); count
    the tokens of the window that opens ``warmup_s`` after the last start."""
    t0 = time.perf_counter()
    window_start = t0 + stagger_s * (len(order) - 1) + warmup_s
    window_end = window_start + window_s
    samples: list[dict[str, Any]] = []

    async def tenant_loop(i: int, tenant: str) -> list[RequestRecord]:
        await asyncio.sleep(stagger_s * i)
        deadline = window_end - time.perf_counter()
        specs = run_specs(load, order, tenant, in_flight * 64)
        return await run_closed_loop(target, specs, in_flight, deadline)

    poll = asyncio.create_task(_poll_engine(target.base_url, admin_token, window_end, samples))
    runs = await asyncio.gather(*(tenant_loop(i, t) for i, t in enumerate(order)))
    await poll
    records = [r for rs in runs for r in rs]
    tokens = tokens_in(records, window_start, window_end)
    in_window = [s for s in samples[int(stagger_s * (len(order) - 1) + warmup_s) :] if s]
    mean_running = {
        t: sum(s.get(t, {}).get("running", 0) for s in in_window) / max(len(in_window), 1)
        for t in weights
    }
    return {
        "order": list(order),
        "in_flight_per_tenant": in_flight,
        "window_s": window_s,
        "tokens": tokens,
        "output_tok_s": sum(tokens.values()) / window_s,
        "share_over_weighted_share": weighted_shares(tokens, weights),
        "mean_running": mean_running,
        "num_errors": sum(1 for r in records if r.error and "deadline" not in r.error),
    }


def _ttft_stats(records: Sequence[RequestRecord], tenant: str) -> dict[str, Any]:
    """A tenant's p99 and worst TTFT, and its three slowest first tokens with when (seconds
    into the run) their requests were sent."""
    ok = [r for r in records if r.tenant == tenant and r.ok]
    ttfts = [r.ttft for r in ok]
    start = min((r.sent_at for r in records), default=0.0)
    slowest = sorted(ok, key=lambda r: r.ttft, reverse=True)[:3]
    return {
        "p99": percentile(ttfts, 99),
        "max": max(ttfts, default=float("nan")),
        "slowest": [{"sent_s": r.sent_at - start, "ttft_s": r.ttft} for r in slowest],
    }


async def flood_run(
    target: Target,
    load: Load,
    light: Sequence[str],
    flooder: str,
    light_in_flight: int,
    factor: int,
    duration_s: float,
    seed: int,
) -> dict[str, Any]:
    """The light tenants alone, then with the flooder at ``factor`` times their in-flight count;
    each light tenant's p99 and worst TTFT, and their ratio to the run without the flooder."""

    async def run(tenants: Sequence[str], run_seed: int) -> list[RequestRecord]:
        loops = [
            run_closed_loop(
                target,
                _specs(load, t, 400, seed=run_seed + i),
                light_in_flight * (factor if t == flooder else 1),
                duration_s,
            )
            for i, t in enumerate(tenants)
        ]
        return [r for rs in await asyncio.gather(*loops) for r in rs]

    # Each run starts on an idle server: the requests the last one cut off at its end are
    # aborted within a step or two, and must not sit in the next run's first steps.
    await asyncio.sleep(QUIET_S)
    calm = await run(light, seed)
    await asyncio.sleep(QUIET_S)
    flood = await run([*light, flooder], seed + 100)
    calm_stats = {t: _ttft_stats(calm, t) for t in light}
    flood_stats = {t: _ttft_stats(flood, t) for t in light}
    return {
        "calm_ttft_s": calm_stats,
        "flood_ttft_s": flood_stats,
        "p99_ratio": {t: flood_stats[t]["p99"] / calm_stats[t]["p99"] for t in light},
        "max_ratio": {t: flood_stats[t]["max"] / calm_stats[t]["max"] for t in light},
        "flooder_requests": sum(1 for r in flood if r.tenant == flooder and r.ok),
        "light_requests": sum(1 for r in flood if r.tenant != flooder and r.ok),
    }
