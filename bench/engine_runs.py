"""Drive an in-process LLMEngine for benchmarks: prefill and decode phases timed apart."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from engine.llm_engine import LLMEngine
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

STEP_PARTS = ("schedule_s", "metadata_s", "forward_s", "sample_s", "postprocess_s")


def random_prompts(
    count: int, length: int, seed: int, low: int = 100, high: int = 20000
) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(count)]


@dataclass(slots=True)
class PhaseResult:
    tokens: int
    seconds: float
    num_steps: int
    split: dict[str, float]  # seconds per step part over the phase

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def stats_delta(before: EngineStats, after: EngineStats) -> dict[str, float]:
    return {part: getattr(after, part) - getattr(before, part) for part in STEP_PARTS}


def _submit(
    engine: LLMEngine, prompts: Sequence[Sequence[int]], max_tokens: int, tag: str
) -> list[str]:
    ids = []
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        request_id = f"{tag}-{i}"
        engine.add_request(GenerateRequest(request_id, list(prompt), params))
        ids.append(request_id)
    return ids


def run_prefill(engine: LLMEngine, prompts: Sequence[Sequence[int]], tag: str) -> PhaseResult:
    """All prompts queued at once, one token each: the engine's prompt throughput."""
    _submit(engine, prompts, 1, tag)
    before = engine.stats.copy()
    start = time.perf_counter()
    while engine.has_unfinished:
        engine.step()
    seconds = time.perf_counter() - start
    after = engine.stats
    tokens = sum(len(p) for p in prompts)
    return PhaseResult(
        tokens, seconds, after.num_steps - before.num_steps, stats_delta(before, after)
    )


def run_decode(
    engine: LLMEngine, prompts: Sequence[Sequence[int]], new_tokens: int, tag: str
) -> PhaseResult:
    """A batch prefilled first (untimed), then ``new_tokens`` decode steps per request timed."""
    ids = set(_submit(engine, prompts, new_tokens + 1, tag))
    started: set[str] = set()
    while started != ids:
        for out in engine.step():
            if out.token_ids:
                started.add(out.request_id)
    before = engine.stats.copy()
    tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished:
        tokens += sum(len(out.token_ids) for out in engine.step())
    seconds = time.perf_counter() - start
    after = engine.stats
    return PhaseResult(
        tokens, seconds, after.num_steps - before.num_steps, stats_delta(before, after)
    )


def split_shares(split: dict[str, float], wall_s: float) -> dict[str, float]:
    """Each step part as a fraction of the phase's wall time, plus what the counters miss."""
    shares = {part.removesuffix("_s"): secs / wall_s for part, secs in split.items()}
    shares["unaccounted"] = max(0.0, 1.0 - sum(shares.values()))
    return shares
