"""AsyncEngine: concurrent streams, aborts and cancellation free pages, a dead loop is reported."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.errors import EngineDeadError, InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel, load_model
from engine.outputs import GenerateRequest, RequestOutput
from engine.sampling_params import SamplingParams
from tests.support.async_engine import collect, greedy_request, wait_for


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


def new_engine(tiny: LoadedModel) -> AsyncEngine:
    config = EngineConfig(num_pages=32, max_num_batched_tokens=64, max_num_seqs=8)
    return AsyncEngine(LLMEngine(tiny, config))


def request(rid: str, max_tokens: int = 6, prompt_len: int = 10) -> GenerateRequest:
    return greedy_request(rid, list(range(1, prompt_len + 1)), max_tokens)


def test_concurrent_generates_stream_to_their_own_consumers(tiny: LoadedModel) -> None:
    async def main() -> None:
        engine = new_engine(tiny)
        engine.start()
        try:
            results = await asyncio.gather(
                *(collect(engine, request(f"r{i}", 3 + i, 5 + 3 * i)) for i in range(5))
            )
            for i, outputs in enumerate(results):
                assert {o.request_id for o in outputs} == {f"r{i}"}
                assert sum(len(o.token_ids) for o in outputs) == 3 + i
                assert outputs[-1].finished and outputs[-1].finish_reason == "length"
            assert engine.num_unfinished == 0
            with pytest.raises(InvalidRequestError):
                await collect(engine, GenerateRequest("bad", [], SamplingParams()))
            assert len(await collect(engine, request("after"))) == 6  # still serving
            await wait_for(lambda: engine.stats().counters.num_finished == 6)
        finally:
            await engine.shutdown()
        with pytest.raises(EngineDeadError):
            await collect(engine, request("late"))

    asyncio.run(main())


def test_consumer_that_stops_or_is_cancelled_aborts_its_request(tiny: LoadedModel) -> None:
    async def main() -> None:
        engine = new_engine(tiny)
        engine.start()
        try:
            stream = engine.generate(request("early", max_tokens=500))
            async for _ in stream:
                break
            await stream.aclose()
            task = asyncio.create_task(collect(engine, request("cancelled", max_tokens=500)))
            await wait_for(lambda: engine.stats().num_running == 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await wait_for(lambda: engine.num_unfinished == 0)
            await wait_for(lambda: engine.stats().num_pages_free == 32)
            assert engine.stats().counters.num_aborted == 2
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_explicit_abort_ends_the_stream_with_abort(tiny: LoadedModel) -> None:
    async def main() -> None:
        engine = new_engine(tiny)
        engine.start()
        try:
            outputs: list[RequestOutput] = []
            async for output in engine.generate(request("a", max_tokens=500)):
                outputs.append(output)
                if len(outputs) == 2:
                    engine.abort("a")
            assert outputs[-1].finish_reason == "abort"
            assert len(outputs) < 500
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_dying_loop_fails_pending_requests_and_refuses_new_ones(tiny: LoadedModel) -> None:
    async def main() -> None:
        engine = new_engine(tiny)
        inner = engine._engine

        def broken_snapshot() -> object:
            raise RuntimeError("boom")

        engine.start()
        try:
            stream = engine.generate(request("victim", max_tokens=500))
            first = await anext(stream)
            assert not first.finished
            inner.snapshot = broken_snapshot  # type: ignore[method-assign, assignment]
            rest = [o async for o in stream]
            assert rest[-1].finish_reason == "error" and "boom" in (rest[-1].error or "")
            with pytest.raises(EngineDeadError):
                await collect(engine, request("next"))
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_request_is_stamped_with_its_arrival_before_the_loop_takes_it(
    tiny: LoadedModel,
) -> None:
    async def main() -> None:
        llm = LLMEngine(tiny, EngineConfig(num_pages=32, max_num_batched_tokens=64, max_num_seqs=8))
        taken: list[float | None] = []
        add = llm.add_request

        def spy(request: GenerateRequest) -> None:
            taken.append(request.arrived_at)
            add(request)

        llm.add_request = spy  # type: ignore[method-assign]
        engine = AsyncEngine(llm)
        engine.start()
        try:
            before = time.monotonic()
            await collect(engine, request("stamped"))
            given = greedy_request("given", list(range(1, 11)), 2)
            given.arrived_at = before - 5.0  # the caller's own stamp is kept
            await collect(engine, given)
        finally:
            await engine.shutdown()
        assert taken[0] is not None and before <= taken[0] <= time.monotonic()
        assert taken[1] == before - 5.0

    asyncio.run(main())
