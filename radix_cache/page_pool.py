"""The KV page pool: page ids, their owners and O(1) allocate/free.

A page is free, or held by exactly one owner: a request (private pages it is computing) or a
namespace of the radix tree (``tenant:<id>`` / ``public``). The pool never looks inside pages.
"""

from __future__ import annotations

from collections.abc import Iterable

from radix_cache.errors import OutOfPagesError, PageOwnershipError

FREE = ""


class PagePool:
    """Fixed set of page ids ``0..num_pages-1``; not thread-safe (the engine thread owns it)."""

    __slots__ = ("_free", "_owner", "num_pages")

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError("num_pages must be positive")
        self.num_pages = num_pages
        # LIFO free list: recently freed pages are reused first (warm in cache).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._owner: list[str] = [FREE] * num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int, owner: str) -> list[int]:
        """Take ``num_pages`` free pages for ``owner``; raises OutOfPagesError if too few."""
        if not owner:
            raise ValueError("owner must be a non-empty tag")
        if num_pages > len(self._free):
            raise OutOfPagesError(f"need {num_pages} pages, {len(self._free)} free")
        if num_pages <= 0:
            return []
        pages = self._free[-num_pages:]
        del self._free[-num_pages:]
        for page in pages:
            self._owner[page] = owner
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the pool; freeing a free page is an error (double free)."""
        for page in pages:
            if self._owner[page] == FREE:
                raise PageOwnershipError(f"page {page} freed twice")
            self._owner[page] = FREE
            self._free.append(page)

    def owner(self, page: int) -> str:
        return self._owner[page]

    def transfer(self, pages: Iterable[int], new_owner: str) -> None:
        """Hand allocated pages to another owner (a request's pages entering the tree)."""
        for page in pages:
            if self._owner[page] == FREE:
                raise PageOwnershipError(f"page {page} is free and cannot change owner")
            self._owner[page] = new_owner

    def check_integrity(self) -> None:
        """Every page is either in the free list exactly once or owned; raises on violation."""
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise PageOwnershipError("a page sits twice in the free list")
        for page in range(self.num_pages):
            is_free = self._owner[page] == FREE
            if is_free != (page in free_set):
                raise PageOwnershipError(f"page {page}: owner and free list disagree")
