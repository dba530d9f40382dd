"""Where a decode step's time goes: torch.profiler's operators over a few engine steps."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from torch.profiler import ProfilerActivity, profile

from engine.llm_engine import LLMEngine
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams


def profile_decode_steps(
    engine: LLMEngine, prompts: Sequence[Sequence[int]], num_steps: int, top: int = 12
) -> dict[str, Any]:
    """Prefill ``prompts`` (untimed), profile ``num_steps`` decode steps, then abort them all."""
    params = SamplingParams(max_tokens=num_steps + 8, temperature=0.0, ignore_eos=True)
    ids = [f"profile-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(GenerateRequest(request_id, list(prompt), params))
    started: set[str] = set()
    while started != set(ids):
        started.update(out.request_id for out in engine.step() if out.token_ids)
    begin = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            engine.step()
    wall = time.perf_counter() - begin
    for request_id in ids:
        engine.abort(request_id)
    engine.step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_us = sum(e.self_cpu_time_total for e in events) or 1.0
    return {
        "batch": len(prompts),
        "steps": num_steps,
        "step_ms": 1e3 * wall / num_steps,
        "top_ops": [
            {
                "op": e.key,
                "self_ms_per_step": e.self_cpu_time_total / 1e3 / num_steps,
                "calls_per_step": e.count / num_steps,
                "share": e.self_cpu_time_total / total_us,
            }
            for e in events[:top]
        ],
    }
