"""Keep what start-up built out of the cyclic garbage collector's full passes.

A full collection walks every live container object. A serving process ends its start-up
holding hundreds of thousands that live as long as it does (modules, the tokenizer, the model's
modules and weights' wrappers, compiled SQL and routes); walking them paused the gateway and the
engine for 0.15-0.36 s a time on a 2-core AMD EPYC, with every request in flight waiting. Once
start-up is over they go to the permanent generation (``gc.freeze``), and full collections walk
only what serving has created since.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def freeze_startup() -> None:
    """Collect once, then move every object alive now out of later collections' reach."""
    gc.collect()
    gc.freeze()


@contextmanager
def frozen_startup() -> Iterator[None]:
    """``freeze_startup`` for the span of the block; the objects are collectable again after
    (a process that builds and drops servers, such as a test run, frees what they left)."""
    freeze_startup()
    try:
        yield
    finally:
        gc.unfreeze()
