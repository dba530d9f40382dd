"""The TTL cache of auth contexts: expiry, invalidation by key and by tenant."""

from __future__ import annotations

import pytest

from tenants.auth_cache import AuthCache
from tenants.schemas import AuthContext, Quotas


def _ctx(tenant: str, key: str) -> AuthContext:
    return AuthContext(
        tenant_id=tenant,
        tenant_name=tenant,
        key_id=key,
        weight=1.0,
        status="active",
        quotas=Quotas(),
    )


def test_entries_expire_and_are_dropped_by_key_or_tenant() -> None:
    now = [0.0]
    cache = AuthCache(ttl_s=1.0, monotonic=lambda: now[0])
    cache.put("h1", _ctx("t1", "k1"))
    cache.put("h2", _ctx("t1", "k2"))
    cache.put("h3", _ctx("t2", "k3"))
    assert cache.get("h1") == _ctx("t1", "k1")
    cache.drop_key("k1")
    assert cache.get("h1") is None and cache.get("h2") is not None
    cache.drop_tenant("t1")
    assert cache.get("h2") is None and cache.get("h3") is not None
    now[0] = 1.0
    assert cache.get("h3") is None and len(cache) == 0


def test_ttl_is_capped_at_one_second() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        AuthCache(ttl_s=5.0)


def test_refusals_expire_and_stay_bounded() -> None:
    now = [0.0]
    cache = AuthCache(max_entries=3, monotonic=lambda: now[0], refusal_ttl_s=5.0)
    for key_hash in ("a", "b", "c"):
        cache.refuse(key_hash)
    assert all(cache.refused(h) for h in ("a", "b", "c")) and not cache.refused("d")
    cache.refuse("d")  # full: the oldest refusal is forgotten (it would simply re-query)
    assert not cache.refused("a") and cache.refused("d")
    now[0] = 5.0
    assert not any(cache.refused(h) for h in ("b", "c", "d"))
    assert not AuthCache(refusal_ttl_s=0.0).refused("x")
