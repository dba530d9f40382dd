"""Tenant isolation and cache shares: caps, own pages first, weighted eviction under pressure."""

import pytest

from radix_cache import PagePool, RadixPrefixCache, SharePolicy, tenant_namespace

PS = 2
A, B, C = tenant_namespace("a"), tenant_namespace("b"), tenant_namespace("c")


def toks(*pages: int) -> list[int]:
    return [t for page in pages for t in (page, page)]


def cache_pages(cache: RadixPrefixCache, ns: str, owner: str, tokens: list[int]) -> object:
    """Compute and cache ``tokens`` for a request that keeps its lock; returns the locked node."""
    pages = cache.allocate(len(tokens) // PS, owner, ns)
    return cache.cache(ns, tokens, pages, owner, None).node


def fill(cache: RadixPrefixCache, ns: str, tokens: list[int], owner: str = "req:x") -> None:
    cache.unlock(cache_pages(cache, ns, owner, tokens))
    cache.check_integrity()


def resident(cache: RadixPrefixCache, ns: str) -> int:
    return cache.tree.stats(ns).resident_pages


def test_policy_caps_and_weighted_excess() -> None:
    policy = SharePolicy(cacheable_pages=10)
    policy.set_share(A, 0.25)
    policy.set_share(B, 0.1, weight=4.0)
    assert (policy.cap(A), policy.cap(B), policy.cap(C)) == (2, 1, None)
    assert policy.excess(A, 5) == 3 and policy.excess(C, 100) == 0
    assert policy.is_protected(A, 2) and not policy.is_protected(A, 3)
    # A is 3 over at weight 1; B is 7 over at weight 4 (1.75): A is furthest over.
    assert policy.furthest_over({A: 5, B: 8}.__getitem__, lambda ns: 1) == A
    assert policy.furthest_over({A: 5, B: 8}.__getitem__, {A: 0, B: 1}.__getitem__) == B
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError):
            policy.set_share(A, bad)
    with pytest.raises(ValueError):
        policy.set_share(A, 0.5, weight=0.0)


def test_a_tenant_never_matches_another_tenants_prefix() -> None:
    cache = RadixPrefixCache(PagePool(8), PS)
    fill(cache, A, toks(1, 2, 3))
    assert cache.match(B, toks(1, 2, 3)).page_ids == []
    fill(cache, B, toks(1, 2, 3), owner="req:b")
    a_pages = cache.match(A, toks(1, 2, 3)).page_ids
    b_pages = cache.match(B, toks(1, 2, 3)).page_ids
    assert len(a_pages) == len(b_pages) == 3 and not set(a_pages) & set(b_pages)


@pytest.mark.parametrize("a_share", [0.3, None])
def test_filling_by_another_tenant_spares_pages_within_a_share(a_share: float | None) -> None:
    cache = RadixPrefixCache(PagePool(10), PS)
    cache.set_share(A, a_share)
    fill(cache, A, toks(1, 2, 3))  # 3 pages: exactly A's cap with a share
    for i in range(12):  # B caches far more than the pool holds
        fill(cache, B, toks(100 + i, 200 + i), owner=f"req:b{i}")
    kept = cache.match(A, toks(1, 2, 3)).num_tokens
    assert kept == (6 if a_share is not None else 0)


def test_a_tenant_over_its_share_loses_its_own_pages_first() -> None:
    cache = RadixPrefixCache(PagePool(10), PS)
    cache.set_share(A, 0.3)
    fill(cache, B, toks(50, 51))
    fill(cache, A, toks(1, 2, 3))
    fill(cache, A, toks(7, 8))  # 5 pages > cap 3: A's least recently used go
    assert resident(cache, A) == 3
    assert cache.match(A, toks(7, 8)).num_tokens == 4
    assert cache.match(A, toks(1, 2, 3)).num_tokens == 2
    assert resident(cache, B) == 2


def test_lowering_a_share_trims_at_once_and_locked_pages_survive() -> None:
    cache = RadixPrefixCache(PagePool(10), PS)
    fill(cache, B, toks(9))  # B's page is the least recently used of all
    held = cache_pages(cache, A, "req:1", toks(1, 2))
    fill(cache, A, toks(3, 4))
    cache.set_share(A, 0.0)
    assert resident(cache, A) == 2  # only the locked pages remain
    assert cache.match(A, toks(1, 2)).num_tokens == 4
    cache.unlock(held)
    cache.allocate(9, "req:2", B)  # A is still over its share and loses before plain LRU
    assert resident(cache, A) == 0 and resident(cache, B) == 1
    cache.check_integrity()


def test_pressure_takes_from_the_tenant_furthest_over_its_weighted_share() -> None:
    cache = RadixPrefixCache(PagePool(12), PS)
    held_a = cache_pages(cache, A, "req:a", toks(1, 2, 3, 4, 5))
    held_c = cache_pages(cache, C, "req:c", toks(1, 2, 3, 4, 5))
    cache.set_share(A, 0.25)  # cap 3: 2 over at weight 1
    cache.set_share(C, 1 / 6, weight=2.0)  # cap 2: 3 over at weight 2 (1.5)
    cache.unlock(held_a)
    cache.unlock(held_c)
    cache.allocate(2, "req:b", B)  # the free pages, nothing evicted
    assert (resident(cache, A), resident(cache, C)) == (5, 5)
    cache.allocate(1, "req:b", B)
    assert (resident(cache, A), resident(cache, C)) == (4, 5)
    cache.allocate(1, "req:b", B)
    assert (resident(cache, A), resident(cache, C)) == (4, 4)
    cache.check_integrity()
