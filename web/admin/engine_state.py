"""Turns the engine's `EngineSnapshot` into the admin API's `EngineState` (with tenant names).

Tokens/s is measured between two polls from the engine's cumulative token counters.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from engine.stats import EngineSnapshot
from web.admin.schemas import EngineInstanceState, EngineState, TenantEngineState

MIN_INTERVAL_S = 0.5
TENANT_PREFIX = "tenant:"
BATCH_SUFFIX = "/batch"  # a tenant's batch lines in the engine (``Principal.engine_tenant_id``)


@dataclass(slots=True)
class TokenRate:
    """Tokens per second between successive samples of a cumulative counter."""

    last_at: float | None = None
    last_tokens: int = 0
    rate: float = 0.0

    def sample(self, tokens: int, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        if self.last_at is None or tokens < self.last_tokens:
            self.last_at, self.last_tokens = now, tokens
        elif now - self.last_at >= MIN_INTERVAL_S:
            self.rate = (tokens - self.last_tokens) / (now - self.last_at)
            self.last_at, self.last_tokens = now, tokens
        return self.rate


def processed_tokens(snapshot: EngineSnapshot) -> int:
    counters = snapshot.counters
    return counters.num_prefill_tokens + counters.num_generated_tokens


def hit_rate(snapshot: EngineSnapshot) -> float | None:
    """Share of prompt tokens served from the prefix cache since start."""
    counters = snapshot.counters
    prompt = counters.num_prefill_tokens + counters.num_cached_tokens
    return counters.num_cached_tokens / prompt if prompt else None


def draft_acceptance(snapshot: EngineSnapshot) -> float | None:
    """Share of drafted tokens the model accepted since start (None: no drafting)."""
    counters = snapshot.counters
    drafted = counters.num_draft_tokens
    return counters.num_accepted_draft_tokens / drafted if drafted else None


def engine_tenant_name(engine_tenant_id: str, names: Mapping[str, str]) -> str | None:
    """A tenant's name for an engine's tenant id: ``acme``, or ``acme (batch)`` for its Batch
    API lines (which the engine schedules apart, as ``<tenant id>/batch``); None for a tenant
    ``names`` does not know."""
    tenant_id, batch, _ = engine_tenant_id.partition(BATCH_SUFFIX)
    name = names.get(tenant_id)
    if name is None:
        return None
    return f"{name} (batch)" if batch else name


def tenant_states(snapshot: EngineSnapshot, names: Mapping[str, str]) -> list[TenantEngineState]:
    """Each tenant with requests or cached pages in ``snapshot``, by name."""
    caches = {
        namespace.removeprefix(TENANT_PREFIX): numbers
        for namespace, numbers in snapshot.cache_by_namespace.items()
        if namespace.startswith(TENANT_PREFIX)
    }
    tenant_ids = set(snapshot.running_by_tenant) | set(snapshot.waiting_by_tenant) | set(caches)
    tenants = []
    for tenant_id in tenant_ids:
        cache = caches.get(tenant_id)
        tenants.append(
            TenantEngineState(
                tenant_id=tenant_id,
                tenant_name=engine_tenant_name(tenant_id, names),
                running=snapshot.running_by_tenant.get(tenant_id, 0),
                waiting=snapshot.waiting_by_tenant.get(tenant_id, 0),
                kv_pages_cached=cache.resident_pages if cache else 0,
                hit_rate=cache.hit_rate if cache and cache.queried_tokens else None,
            )
        )
    tenants.sort(key=lambda t: t.tenant_name or t.tenant_id)
    return tenants


def to_engine_state(
    snapshot: EngineSnapshot, names: Mapping[str, str], tokens_per_s: float
) -> EngineState:
    return EngineState(
        tokens_per_s=tokens_per_s,
        num_running=snapshot.num_running,
        num_waiting=snapshot.num_waiting,
        kv_pages_total=snapshot.num_pages_total,
        kv_pages_free=snapshot.num_pages_free,
        hit_rate=hit_rate(snapshot),
        tenants=tenant_states(snapshot, names),
    )


def to_instance_state(
    url: str,
    healthy: bool,
    snapshot: EngineSnapshot,
    tokens_per_s: float,
    names: Mapping[str, str] | None = None,
) -> EngineInstanceState:
    return EngineInstanceState(
        url=url,
        healthy=healthy,
        tokens_per_s=tokens_per_s,
        num_running=snapshot.num_running,
        num_waiting=snapshot.num_waiting,
        kv_pages_total=snapshot.num_pages_total,
        kv_pages_free=snapshot.num_pages_free,
        kv_pages_cached=max(snapshot.num_pages_available - snapshot.num_pages_free, 0),
        hit_rate=hit_rate(snapshot),
        num_preemptions=snapshot.counters.num_preemptions,
        draft_acceptance=draft_acceptance(snapshot),
        tenants=tenant_states(snapshot, names or {}),
    )
