"""Engine counters and the snapshot handed to other threads (benchmarks, admin API)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Literal

from radix_cache.stats import NamespaceSnapshot


@dataclass(slots=True)
class EngineStats:
    """Cumulative since start; updated by the engine thread only."""

    num_steps: int = 0
    schedule_s: float = 0.0
    metadata_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    postprocess_s: float = 0.0
    num_prefill_tokens: int = 0  # prompt (or recomputed) tokens run through the model
    num_decode_tokens: int = 0  # decoded tokens (a decode's own and its accepted draft)
    num_draft_tokens: int = 0  # guessed tokens checked (engine/speculative.py)
    num_accepted_draft_tokens: int = 0  # of those, the ones the model would have chosen
    num_generated_tokens: int = 0  # tokens sampled
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_overlapped_steps: int = 0  # steps whose ids were read after the next one launched

    def copy(self) -> EngineStats:
        return replace(self)


Phase = Literal["schedule", "metadata", "forward", "sample", "postprocess"]


class StepTimer:
    """One step's clock: each ``lap`` charges the time since the previous one to that phase's
    counter in ``EngineStats`` (``schedule_s``, ``metadata_s``, ...): the phases tile the step."""

    __slots__ = ("last", "start_ns", "started", "stats")

    def __init__(self, stats: EngineStats, wall_clock: bool = False) -> None:
        self.stats = stats
        self.start_ns = time.time_ns() if wall_clock else 0  # for traces (epoch nanoseconds)
        self.started = self.last = time.perf_counter()

    def lap(self, phase: Phase) -> None:
        now = time.perf_counter()
        name = f"{phase}_s"
        setattr(self.stats, name, getattr(self.stats, name) + now - self.last)
        self.last = now

    def finish(self) -> float:
        """End a step that ran the model (postprocess included); its seconds, start to end."""
        self.lap("postprocess")
        self.stats.num_steps += 1
        return self.last - self.started


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """A consistent, immutable picture of the engine at the end of one step."""

    running_by_tenant: dict[str, int] = field(default_factory=dict)
    waiting_by_tenant: dict[str, int] = field(default_factory=dict)
    # Seconds each tenant's longest-waiting request has waited (tenants with none waiting absent).
    queue_wait_by_tenant: dict[str, float] = field(default_factory=dict)
    num_pages_total: int = 0
    num_pages_free: int = 0
    num_pages_available: int = 0  # free plus evictable cached pages
    page_size: int = 0
    counters: EngineStats = field(default_factory=EngineStats)
    cache_by_namespace: dict[str, NamespaceSnapshot] = field(default_factory=dict)
    # LoRA adapters (engine/lora/): resident slots (0: adapters off), and the adapters of the
    # running and of the waiting requests, each once, in arrival order.
    max_loras: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    taken_at: float = 0.0  # when it was taken (seconds since the epoch; 0: never)

    @property
    def num_running(self) -> int:
        return sum(self.running_by_tenant.values())

    @property
    def num_waiting(self) -> int:
        return sum(self.waiting_by_tenant.values())
