"""Measures a step's costs on this machine at start: one decode, a batch of decodes, a chunk.

Runs the model on made-up rows in pages borrowed from the (still empty) pool and handed back;
the KV written there is never read by a request (a page's tokens count only once a request
computes them). A few hundred milliseconds on a CPU for the default model.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from engine.load_progress import LoadProgress, NullProgress
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq
from engine.step_target import StepCosts
from radix_cache.page_pool import PagePool

OWNER = "req:step-calibration"
CONTEXT_TOKENS = 128  # each made-up decode attends to this many tokens
MAX_DECODES = 16
MAX_CHUNK = 128
REPEATS = 3  # the first run of each shape warms up; the fastest of the rest counts
SHAPES = 3  # one decode, a batch of decodes, a prefill chunk


def _request(num_tokens: int, pages: list[int]) -> Request:
    request = Request(
        request_id="step-calibration",
        prompt_token_ids=[0] * num_tokens,
        params=SamplingParams(max_tokens=1),
        tenant_id="",
        namespace="",
        owner=OWNER,
        arrival_index=0,
    )
    request.block_table = pages
    return request


def _fastest(run: Callable[[], object], device: torch.device, progress: LoadProgress) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        progress.advance()
    return min(times[1:])


def measure_step_costs(
    runner: ModelRunner,
    pool: PagePool,
    max_num_seqs: int,
    token_budget: int,
    progress: LoadProgress | None = None,
) -> StepCosts:
    """Time steps of one decode, of ``d`` decodes and of one prefill chunk, and solve for the
    fixed, per-decode and per-token costs; ``progress`` is told of each step as the stage
    ``warm up``. ValueError (before any step) when the pool is too small for them."""
    progress = progress or NullProgress()
    page_size = runner.page_size
    pages_per_decode = -(-(CONTEXT_TOKENS + 1) // page_size)
    chunk = min(MAX_CHUNK, token_budget)
    pages_per_chunk = -(-chunk // page_size)
    num_decodes = min(
        MAX_DECODES,
        max_num_seqs,
        (pool.num_free_pages - pages_per_chunk) // max(pages_per_decode, 1),
    )
    if num_decodes < 2:
        raise ValueError("too few KV pages to measure a step's costs")
    progress.stage("warm up", total=SHAPES * REPEATS, unit="steps")
    pages = pool.allocate(num_decodes * pages_per_decode + pages_per_chunk, OWNER)
    try:
        decodes = []
        for i in range(num_decodes):
            request = _request(
                CONTEXT_TOKENS + 1, pages[i * pages_per_decode : (i + 1) * pages_per_decode]
            )
            request.num_computed_tokens = CONTEXT_TOKENS
            decodes.append(ScheduledSeq(request, 1, True))
        prefill = ScheduledSeq(
            _request(chunk, pages[num_decodes * pages_per_decode :]), chunk, True
        )
        device = runner.device

        def step(seqs: list[ScheduledSeq]) -> Callable[[], object]:
            return lambda: runner.forward(runner.prepare(seqs))

        one = _fastest(step(decodes[:1]), device, progress)
        many = _fastest(step(decodes), device, progress)
        prefill_s = _fastest(step([prefill]), device, progress)
    finally:
        pool.free(pages)
    per_decode = max((many - one) / (num_decodes - 1), 1e-6)
    fixed = max(one - per_decode, 0.0)
    per_token = max((prefill_s - fixed) / chunk, 1e-7)
    return StepCosts(fixed, per_decode, per_token)
