"""Measures a step's costs on this machine at start: one decode, a batch of decodes over short
and over long contexts, a chunk.

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
LONG_CONTEXT_TOKENS = 1024  # ... and in the batch that measures the cost of context
MAX_DECODES = 16
MAX_CHUNK = 128
REPEATS = 3  # the first run of each shape warms up; the fastest of the rest counts
SHAPES = 4  # one decode, a batch of decodes over short and long contexts, a prefill chunk


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
    max_model_len: int | None = None,
) -> StepCosts:
    """Time steps of one decode, of ``d`` decodes over short contexts and over long ones, and of
    one prefill chunk, and solve for the fixed, per-decode, per-context-token and per-prompt-token
    costs; ``progress`` is told of each step as the stage ``warm up``. The long contexts stay
    within ``max_model_len``, and are left out (no context cost) when the pool cannot hold them.
    ValueError (before any step) when the pool is too small for the rest."""
    progress = progress or NullProgress()
    page_size = runner.page_size
    pages_per_decode = -(-(CONTEXT_TOKENS + 1) // page_size)
    long_context = min(LONG_CONTEXT_TOKENS, (max_model_len or LONG_CONTEXT_TOKENS + 1) - 1)
    pages_per_long = -(-(long_context + 1) // page_size)
    chunk = min(MAX_CHUNK, token_budget)
    pages_per_chunk = -(-chunk // page_size)
    num_decodes = min(
        MAX_DECODES,
        max_num_seqs,
        (pool.num_free_pages - pages_per_chunk) // max(pages_per_decode, 1),
    )
    if num_decodes < 2:
        raise ValueError("too few KV pages to measure a step's costs")
    num_pages = num_decodes * pages_per_decode + pages_per_chunk
    long_contexts = (
        long_context > CONTEXT_TOKENS
        and pool.num_free_pages >= num_pages + num_decodes * pages_per_long
    )
    progress.stage("warm up", total=(SHAPES - (not long_contexts)) * REPEATS, unit="steps")
    pages = pool.allocate(num_pages + (num_decodes * pages_per_long if long_contexts else 0), OWNER)
    try:
        taken = iter(pages)

        def decode(context: int, num_pages: int) -> ScheduledSeq:
            request = _request(context + 1, [next(taken) for _ in range(num_pages)])
            request.num_computed_tokens = context
            return ScheduledSeq(request, 1, True)

        decodes = [decode(CONTEXT_TOKENS, pages_per_decode) for _ in range(num_decodes)]
        prefill = ScheduledSeq(
            _request(chunk, [next(taken) for _ in range(pages_per_chunk)]), chunk, True
        )
        longs = (
            [decode(long_context, pages_per_long) for _ in range(num_decodes)]
            if long_contexts
            else []
        )
        device = runner.device

        def step(seqs: list[ScheduledSeq]) -> Callable[[], object]:
            return lambda: runner.forward(runner.prepare(seqs))

        one = _fastest(step(decodes[:1]), device, progress)
        many = _fastest(step(decodes), device, progress)
        prefill_s = _fastest(step([prefill]), device, progress)
        many_long = _fastest(step(longs), device, progress) if longs else many
    finally:
        pool.free(pages)
    extra_context = num_decodes * max(long_context - CONTEXT_TOKENS, 1)
    per_context = max((many_long - many) / extra_context, 0.0)
    per_decode_at_short = max((many - one) / (num_decodes - 1), 1e-6)
    per_decode = max(per_decode_at_short - per_context * CONTEXT_TOKENS, 1e-6)
    fixed = max(one - per_decode_at_short, 0.0)
    per_token = max((prefill_s - fixed) / chunk, 1e-7)
    return StepCosts(fixed, per_decode, per_token, per_context)
