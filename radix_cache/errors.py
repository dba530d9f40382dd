"""Errors raised by the KV page resource layer (no dependency on the rest of Atrium)."""


class CacheError(Exception):
    """Base of radix_cache errors."""


class OutOfPagesError(CacheError):
    """The pool (after any eviction allowed) cannot provide the pages asked for."""


class PageOwnershipError(CacheError):
    """A page was used, freed or transferred by someone who does not own it."""


class IsolationError(PageOwnershipError):
    """A block table holds a page of another tenant's namespace: never allowed."""


class StaleNodeError(CacheError):
    """A node handle was used after its pages were evicted (lock promptly after ``match``)."""


class IntegrityError(CacheError):
    """An internal invariant of the cache is broken: a bug, found by ``check_integrity``."""
