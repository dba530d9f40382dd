"""Start-up objects leave the collector's full passes while serving, and come back after."""

from __future__ import annotations

import gc

from engine.heap import frozen_startup


def test_objects_alive_at_start_up_are_frozen_and_later_ones_are_not() -> None:
    assert gc.get_freeze_count() == 0
    startup = [[i] for i in range(100)]  # containers the collector tracks
    with frozen_startup():
        assert gc.get_freeze_count() >= len(startup)
        walked = {id(o) for o in gc.get_objects()}
        assert not any(id(o) in walked for o in startup)  # full collections skip them
        serving = [[i] for i in range(10)]
        assert all(id(o) in {id(x) for x in gc.get_objects()} for o in serving)
    assert gc.get_freeze_count() == 0
    assert id(startup[0]) in {id(o) for o in gc.get_objects()}
