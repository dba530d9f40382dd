"""RadixPrefixCache: ownership of pages across allocate, match, cache and public prefixes."""

import pytest

from radix_cache import (
    PUBLIC_NAMESPACE,
    CacheError,
    InsertResult,
    IsolationError,
    OutOfPagesError,
    PageOwnershipError,
    PagePool,
    RadixPrefixCache,
    tenant_namespace,
)

PS = 2
A = tenant_namespace("a")
B = tenant_namespace("b")


def toks(*pages: int) -> list[int]:
    return [t for page in pages for t in (page, page)]


def make(num_pages: int = 8) -> RadixPrefixCache:
    return RadixPrefixCache(PagePool(num_pages), PS)


def run_request(cache: RadixPrefixCache, ns: str, owner: str, tokens: list[int]) -> InsertResult:
    """A request's life: match, lock, compute the rest, cache, release."""
    hit = cache.match(ns, tokens)
    cache.lock(hit.node)
    pages = hit.page_ids + cache.allocate(len(tokens) // PS - len(hit.page_ids), owner, ns)
    result = cache.cache(ns, tokens, pages, owner, hit.node)
    cache.check_owner(result.page_ids, ns, owner)
    cache.unlock(result.node)
    cache.free([p for p in result.page_ids if cache.pool.owner(p) == owner])
    cache.check_integrity()
    return result


def test_cached_pages_move_to_the_namespace_and_are_reused() -> None:
    cache = make()
    first = run_request(cache, A, "req:1", toks(1, 2, 3))
    assert {cache.pool.owner(p) for p in first.page_ids} == {A}
    hit = cache.match(A, toks(1, 2, 3, 4))
    assert hit.page_ids == first.page_ids and hit.num_tokens == 6 and hit.namespace == A
    assert cache.num_available_pages == 8


def test_cache_frees_the_requests_duplicate_pages() -> None:
    cache = make()
    owned = cache.allocate(2, "req:1", A)
    twin = cache.allocate(2, "req:2", A)
    first = cache.cache(A, toks(1, 2), owned, "req:1", None)
    second = cache.cache(A, toks(1, 2), twin, "req:2", None)
    assert second.page_ids == owned and second.num_cached_tokens == 4
    assert cache.pool.num_free_pages == 6  # the twin copies went back to the pool
    cache.unlock(first.node)
    cache.unlock(second.node)
    cache.check_integrity()


def test_cache_refuses_pages_the_request_does_not_own_without_changing_anything() -> None:
    cache = make()
    theirs = run_request(cache, A, "req:1", toks(1, 2)).page_ids
    mine = cache.allocate(1, "req:2", B)
    with pytest.raises(IsolationError):
        cache.cache(B, toks(1, 2, 3), [*theirs, *mine], "req:2", None)
    with pytest.raises(IsolationError):
        cache.check_owner(theirs, B, "req:2")
    with pytest.raises(PageOwnershipError):
        cache.cache(B, toks(1, 1), [mine[0], mine[0]], "req:2", None)
    assert cache.match(B, toks(1, 2)).page_ids == []
    cache.check_integrity()


def test_cache_checks_the_locked_prefix_matches_the_tokens() -> None:
    cache = make()
    run_request(cache, A, "req:1", toks(1, 2))
    hit = cache.match(A, toks(1, 2))
    cache.lock(hit.node)
    with pytest.raises(PageOwnershipError):
        cache.cache(A, toks(5, 6), hit.page_ids, "req:2", hit.node)
    cache.unlock(hit.node)
    with pytest.raises(CacheError):
        cache.cache(A, toks(1, 2), hit.page_ids, "req:2", hit.node)  # no lock held any more


def test_allocate_evicts_unlocked_pages_and_fails_only_past_them() -> None:
    cache = make(4)
    run_request(cache, A, "req:1", toks(1, 2))
    held = cache.match(A, toks(1))
    cache.lock(held.node)
    assert cache.num_available_pages == 3
    with pytest.raises(OutOfPagesError):
        cache.allocate(4, "req:2", A)
    pages = cache.allocate(3, "req:2", A)  # evicts the unlocked second page
    assert held.page_ids[0] not in pages
    assert cache.match(A, toks(1, 2)).page_ids == held.page_ids
    cache.check_integrity()
    with pytest.raises(PageOwnershipError):
        cache.allocate(0, A, A)


def test_public_prefixes_serve_every_tenant_only_when_allowed() -> None:
    cache = make()
    cache.publish(toks(1, 2), cache.allocate(2, "publish:1", PUBLIC_NAMESPACE), "publish:1")
    hit = cache.match(A, toks(1, 2, 3))
    assert hit.namespace == PUBLIC_NAMESPACE and hit.num_tokens == 4
    assert cache.match(B, toks(1, 2), allow_public=False).page_ids == []
    own = run_request(cache, A, "req:2", toks(1, 2, 3)).page_ids
    # A's continuation of a public prefix stays private: A keeps matching the public pages.
    assert cache.match(A, toks(1, 2, 3)).namespace == PUBLIC_NAMESPACE
    assert {cache.pool.owner(p) for p in own[:2]} == {PUBLIC_NAMESPACE}
    stats = cache.stats()
    assert stats[A].public_hit_tokens == 12 and stats[A].hit_tokens == 12
    cache.check_integrity()


def test_own_namespace_wins_over_public_when_at_least_as_long() -> None:
    cache = make()
    run_request(cache, A, "req:1", toks(1, 2))
    cache.publish(toks(1, 2), cache.allocate(2, "publish:1", PUBLIC_NAMESPACE), "publish:1")
    assert cache.match(A, toks(1, 2)).namespace == A


def test_published_prefixes_are_pinned_until_unpinned() -> None:
    cache = make(4)
    pages = cache.allocate(2, "publish:1", PUBLIC_NAMESPACE)
    assert cache.publish(toks(1, 2), pages, "publish:1") == 4
    assert (
        cache.publish(toks(1, 2), cache.allocate(2, "publish:2", PUBLIC_NAMESPACE), "publish:2")
        == 4
    )
    assert cache.num_available_pages == 2
    with pytest.raises(OutOfPagesError):
        cache.allocate(3, "req:1", A)
    cache.unpin(cache.match(PUBLIC_NAMESPACE, toks(1, 2)).node)
    assert cache.num_available_pages == 4
    with pytest.raises(CacheError):
        cache.unpin(cache.match(PUBLIC_NAMESPACE, toks(1, 2)).node)
    tenant_node = run_request(cache, A, "req:2", toks(7)).node
    with pytest.raises(IsolationError):
        cache.pin(tenant_node)
    cache.check_integrity()


def test_stats_report_residency_and_hit_rate_per_namespace() -> None:
    cache = make()
    run_request(cache, A, "req:1", toks(1, 2))
    run_request(cache, A, "req:2", toks(1, 2))
    cache.set_share(B, 0.5, weight=2.0)
    stats = cache.stats()
    assert stats[A].resident_pages == 2 and stats[A].queries == 2
    assert stats[A].hit_rate == pytest.approx(0.5)
    assert (stats[B].share, stats[B].weight, stats[B].cap_pages) == (0.5, 2.0, 4)


def test_drop_namespace_frees_a_tenants_cached_pages() -> None:
    cache = make()
    run_request(cache, A, "req:1", toks(1, 2, 3))
    assert cache.drop_namespace(A) == 3
    assert cache.pool.num_free_pages == 8
    assert cache.match(A, toks(1, 2, 3)).page_ids == []
    cache.check_integrity()


def test_handles_must_come_from_the_cache() -> None:
    cache = make()
    with pytest.raises(CacheError):
        cache.lock(object())
    cache.lock(None)
    cache.unlock(None)


def publish(cache: RadixPrefixCache, owner: str, tokens: list[int]) -> int:
    """A publish request's life: match public, compute the rest, hand it to the cache pinned."""
    hit = cache.match(PUBLIC_NAMESPACE, tokens)
    cache.lock(hit.node)
    pages = hit.page_ids + cache.allocate(len(tokens) // PS - len(hit.page_ids), owner, "public")
    return cache.publish(tokens, pages, owner, hit.node)


def test_unpublishing_releases_only_that_prefix_and_stops_sharing_it() -> None:
    cache = make(6)
    assert publish(cache, "publish:1", toks(1, 2)) == 4
    assert publish(cache, "publish:2", toks(1, 2, 3)) == 6  # extends the first
    assert cache.num_available_pages == 3
    # Not published exactly there: nothing is released.
    assert cache.unpublish(toks(1)) == 0 and cache.unpublish(toks(9, 9)) == 0
    assert cache.unpublish([*toks(1, 2), 5]) == 4  # a partial last page is not part of it
    assert cache.num_available_pages == 3  # the longer prefix still pins the shared pages
    assert cache.match(A, toks(1, 2, 3)).num_tokens == 6
    assert cache.unpublish(toks(1, 2)) == 0  # already released
    assert cache.unpublish(toks(1, 2, 3)) == 6
    assert cache.num_available_pages == 6 and cache.pool.num_free_pages == 6
    assert cache.match(A, toks(1, 2, 3)).num_tokens == 0  # tenants no longer share it
    cache.check_integrity()


def test_unpublished_pages_in_use_are_freed_after_their_request() -> None:
    cache = make(6)
    publish(cache, "publish:1", toks(1, 2))
    hit = cache.match(A, toks(1, 2, 3))
    cache.lock(hit.node)  # a tenant request is running on the public pages
    assert cache.unpublish(toks(1, 2)) == 4
    assert cache.pool.num_free_pages == 4 and cache.num_available_pages == 4
    cache.unlock(hit.node)
    assert cache.num_available_pages == 6  # evictable now, no longer pinned
    publish(cache, "publish:2", toks(7))
    assert cache.unpublish(toks(7)) == 2
    assert cache.pool.num_free_pages == 6  # the leftover went with the next unpublish
    cache.check_integrity()
