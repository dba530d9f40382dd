"""Helpers for tests that drive an engine client (in-process or in a child) from asyncio."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from engine.async_engine import EngineClient
from engine.outputs import GenerateRequest, RequestOutput
from engine.sampling_params import SamplingParams


def greedy_request(rid: str, prompt: list[int], max_tokens: int = 6) -> GenerateRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest(rid, prompt, params)


async def collect(engine: EngineClient, req: GenerateRequest) -> list[RequestOutput]:
    return [output async for output in engine.generate(req)]


async def wait_for(predicate: Callable[[], object], timeout: float = 10.0) -> None:
    """Poll ``predicate`` every 10 ms until it is true; fail after ``timeout`` seconds."""
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")
