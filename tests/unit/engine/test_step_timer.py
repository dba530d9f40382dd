"""A step's timing in one place: the phases tile the step, and only steps that ran the model
count as steps."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.stats import EngineStats, StepTimer
from tests.support.greedy import run_greedy

PHASES = ("schedule", "metadata", "forward", "sample", "postprocess")


def phase_seconds(stats: EngineStats) -> list[float]:
    return [getattr(stats, f"{phase}_s") for phase in PHASES]


def test_laps_charge_each_phase_and_tile_the_step() -> None:
    stats = EngineStats(forward_s=1.0)
    timer = StepTimer(stats)
    time.sleep(0.01)
    timer.lap("schedule")
    timer.lap("metadata")
    time.sleep(0.02)
    timer.lap("forward")
    elapsed = timer.finish()
    assert stats.schedule_s >= 0.01
    assert stats.forward_s >= 1.02  # added to what was there
    assert stats.num_steps == 1
    charged = stats.schedule_s + stats.metadata_s + (stats.forward_s - 1.0) + stats.postprocess_s
    assert charged == pytest.approx(elapsed, abs=1e-9)
    assert timer.start_ns == 0  # wall clock only when traced
    assert StepTimer(EngineStats(), wall_clock=True).start_ns > 0


def test_engine_steps_report_every_phase(tiny_llama_dir: Path) -> None:
    config = EngineConfig(num_pages=32, max_num_batched_tokens=64, max_num_seqs=8, dtype="float32")
    engine = LLMEngine(load_model(str(tiny_llama_dir), torch.float32), config)
    before = engine.stats.copy()
    assert engine.step() == []  # nothing to run: scheduled, but not a step of the model
    assert engine.stats.num_steps == before.num_steps
    assert engine.stats.forward_s == before.forward_s
    before = engine.stats.copy()  # the empty step's scheduling is outside the wall timed below
    started = time.perf_counter()
    run_greedy(engine, [list(range(1, 40)), list(range(3, 9))], 5)
    wall = time.perf_counter() - started
    stats = engine.stats
    assert stats.num_steps - before.num_steps >= 5  # a prefill, then a decode per token
    spent = [a - b for a, b in zip(phase_seconds(stats), phase_seconds(before), strict=True)]
    assert all(seconds > 0 for seconds in spent)
    assert sum(spent) <= wall
