"""One node of the page-granular radix tree: an edge of whole pages and its bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class RadixNode:
    """An edge of whole pages under its parent; identity-hashed so it can serve as a handle.

    A namespace root has no parent and an empty edge. ``lock_ref`` counts the locks taken on this
    node or on any node below it, so ``lock_ref == 0`` means the whole subtree may be evicted.
    """

    namespace: str
    tokens: tuple[int, ...]  # edge tokens: len(tokens) == len(page_ids) * page_size
    page_ids: list[int]  # KV pages of the edge, in token order
    parent: RadixNode | None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)  # by first page
    lock_ref: int = 0  # locks on this node or a descendant
    direct_locks: int = 0  # locks whose handle is this very node
    last_access: int = 0  # logical clock; never smaller than any child's
    attached: bool = True  # False once evicted: the handle is stale

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_evictable_leaf(self) -> bool:
        return self.attached and self.parent is not None and not self.children and not self.lock_ref

    def path_root(self) -> RadixNode:
        """The namespace root above this node (itself for a root)."""
        node = self
        while node.parent is not None:
            node = node.parent
        return node

    def path_page_ids(self) -> list[int]:
        """Pages from the namespace root down to and including this node."""
        chunks: list[list[int]] = []
        node: RadixNode | None = self
        while node is not None:
            chunks.append(node.page_ids)
            node = node.parent
        return [page for chunk in reversed(chunks) for page in chunk]

    def path_tokens(self) -> list[int]:
        """Tokens from the namespace root down to and including this node."""
        chunks: list[tuple[int, ...]] = []
        node: RadixNode | None = self
        while node is not None:
            chunks.append(node.tokens)
            node = node.parent
        return [token for chunk in reversed(chunks) for token in chunk]
