"""A request's n-gram drafting state (see ``engine/speculative.py``), apart so that the request
can hold it without importing the drafter that reads the request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class DraftState:
    """A request's n-gram index and its recent luck."""

    index: dict[tuple[int, ...], int] = field(default_factory=dict)
    num_indexed: int = 0  # tokens of all_token_ids whose preceding n-gram is in the index
    pause: int = 0  # steps left without drafting
    next_pause: int = 1  # the pause after the next outright miss
