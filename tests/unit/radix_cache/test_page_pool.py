"""The page pool: allocation, owners, transfer and double frees."""

import pytest

from radix_cache import FREE, OutOfPagesError, PageOwnershipError, PagePool


def test_allocate_gives_distinct_pages_tagged_with_their_owner() -> None:
    pool = PagePool(8)
    first = pool.allocate(3, "req:1")
    second = pool.allocate(5, "req:2")
    assert len(set(first) | set(second)) == 8
    assert {pool.owner(p) for p in first} == {"req:1"}
    assert {pool.owner(p) for p in second} == {"req:2"}
    assert pool.num_free_pages == 0
    pool.check_integrity()


def test_allocate_beyond_free_pages_raises_and_changes_nothing() -> None:
    pool = PagePool(4)
    pool.allocate(3, "req:1")
    assert not pool.can_allocate(2)
    with pytest.raises(OutOfPagesError):
        pool.allocate(2, "req:2")
    assert pool.num_free_pages == 1
    assert pool.allocate(0, "req:2") == []


def test_free_returns_pages_and_double_free_raises() -> None:
    pool = PagePool(4)
    pages = pool.allocate(2, "req:1")
    pool.free(pages)
    assert pool.num_free_pages == 4
    assert all(pool.owner(p) == FREE for p in pages)
    with pytest.raises(PageOwnershipError):
        pool.free(pages[:1])
    pool.check_integrity()


def test_transfer_changes_owner_but_not_a_free_page() -> None:
    pool = PagePool(4)
    pages = pool.allocate(2, "req:1")
    pool.transfer(pages, "tenant:a")
    assert {pool.owner(p) for p in pages} == {"tenant:a"}
    assert pool.num_used_pages == 2
    free_page = next(p for p in range(4) if p not in pages)
    with pytest.raises(PageOwnershipError):
        pool.transfer([free_page], "tenant:a")


def test_check_integrity_detects_a_page_listed_free_twice() -> None:
    pool = PagePool(3)
    pool._free.append(pool._free[0])
    with pytest.raises(PageOwnershipError):
        pool.check_integrity()


def test_invalid_arguments_are_rejected() -> None:
    with pytest.raises(ValueError):
        PagePool(0)
    with pytest.raises(ValueError):
        PagePool(2).allocate(1, "")
