"""Grouping a step's sequences by the leading pages they share."""

from __future__ import annotations

import random

from engine.attention.shared_prefix import PrefixGroup, group_shared_prefixes


def _by_members(groups: list[PrefixGroup]) -> dict[frozenset[int], int]:
    return {frozenset(g.members): g.shared_pages for g in groups}


def test_groups_follow_the_shared_system_pages() -> None:
    system_a, system_b = [1, 2, 3, 4, 5], [6, 7, 8]
    tables = [
        [*system_a, 10],
        [*system_b, 11, 12],
        [*system_a, 13, 14],
        [*system_b, 15],
        [20, 21],
        [*system_a, 16],
    ]
    groups = group_shared_prefixes(tables, [len(t) - 1 for t in tables])
    assert _by_members(groups) == {
        frozenset({0, 2, 5}): 5,
        frozenset({1, 3}): 3,
        frozenset({4}): 0,
    }


def test_a_sequence_sharing_only_the_first_page_stays_out_of_a_long_group() -> None:
    system = [1, 2, 3, 4, 5, 6]
    tables = [[1, 9, 9], [*system, 10], [*system, 11], [*system, 12]]
    groups = group_shared_prefixes(tables, [len(t) - 1 for t in tables])
    assert _by_members(groups) == {frozenset({1, 2, 3}): 6, frozenset({0}): 0}


def test_pages_written_this_step_are_not_shared() -> None:
    # Both hold pages 1, 2, 3, but the second's query tokens start inside page 2.
    tables = [[1, 2, 3, 4], [1, 2, 3]]
    groups = group_shared_prefixes(tables, [3, 1])
    assert _by_members(groups) == {frozenset({0, 1}): 1}


def test_nothing_shared_gives_groups_of_one() -> None:
    tables = [[1, 2], [3, 4], [5]]
    groups = group_shared_prefixes(tables, [2, 2, 1])
    assert sorted(g.members for g in groups) == [(0,), (1,), (2,)]
    assert all(g.shared_pages == 0 for g in groups)


def test_random_tables_are_partitioned_and_shares_are_real() -> None:
    rng = random.Random(7)
    systems = [[rng.randrange(1000) for _ in range(rng.randrange(1, 6))] for _ in range(4)]
    for _ in range(50):
        tables = [
            [*rng.choice(systems)[: rng.randrange(0, 6)], *(rng.randrange(1000, 2000),) * 2]
            for _ in range(rng.randrange(1, 12))
        ]
        usable = [rng.randrange(0, len(t) + 1) for t in tables]
        groups = group_shared_prefixes(tables, usable)
        members = sorted(i for g in groups for i in g.members)
        assert members == list(range(len(tables)))  # each sequence exactly once
        for g in groups:
            assert (g.shared_pages > 0) == (len(g.members) > 1)
            first = tables[g.members[0]][: g.shared_pages]
            for i in g.members:
                assert g.shared_pages <= usable[i]
                assert tables[i][: g.shared_pages] == first
