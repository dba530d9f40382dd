"""Which sequences of a step read the same leading pages, so their attention can read them once.

Sequences that share a cached prefix hold the same page ids at the front of their block tables
(the radix cache hands out the same pages; tenants never share pages). Sorting the tables puts
such sequences next to each other; a greedy pass then cuts the sorted order into groups, each
with the number of whole pages all its members share. Cost: the step's pages, times log of the
number of sequences for the sort.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefixGroup:
    members: tuple[int, ...]  # indices into the step's sequences, in sorted-table order
    shared_pages: int  # leading pages every member holds (0 for a sequence on its own)


def _common_pages(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(limit, len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def group_shared_prefixes(
    tables: Sequence[Sequence[int]], usable_pages: Sequence[int]
) -> list[PrefixGroup]:
    """Partition sequences into groups sharing whole leading pages.

    ``usable_pages[i]`` caps what sequence ``i`` may share: its whole pages that lie before its
    first query token (later pages are being written this step). In sorted order, neighbours
    stay together unless they share nothing or less than half of what either shares with its
    other neighbour (so one sequence that shares just a first page does not drag a group that
    shares a long system prompt down to that page). Every sequence is in exactly one group; a
    group of one shares nothing.
    """
    n = len(tables)
    order = sorted(range(n), key=lambda i: tuple(tables[i][: usable_pages[i]]))
    adjacent = [
        _common_pages(tables[a], tables[b], min(usable_pages[a], usable_pages[b]))
        for a, b in itertools.pairwise(order)
    ]
    best = [max(adjacent[k - 1] if k else 0, adjacent[k] if k < n - 1 else 0) for k in range(n)]
    groups: list[PrefixGroup] = []
    start = 0
    for k in range(n):
        last = k == n - 1
        if last or adjacent[k] == 0 or 2 * adjacent[k] < max(best[k], best[k + 1]):
            run = tuple(order[start : k + 1])
            shared = min(adjacent[start:k]) if len(run) > 1 else 0
            groups.append(PrefixGroup(run, shared))
            start = k + 1
    return groups
