"""ProcessEngine: the step loop in a child process gives what the in-process engine gives.

Greedy outputs equal the in-process ``LLMEngine``'s; request errors cross with their type and
parameter; aborts and cancelled consumers free pages; a child that dies fails its requests and
refuses new ones; shutdown ends the child; a model that cannot load fails ``start`` clearly; a
parent killed while the child loads takes the child with it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import EngineDeadError, EngineError, InvalidRequestError, PromptTooLongError
from engine.factory import EngineSpec
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model, load_tokenizer
from engine.outputs import GenerateRequest, RequestOutput
from engine.process_engine import ProcessEngine
from engine.sampling_params import SamplingParams
from tests.support.async_engine import collect, greedy_request
from tests.support.async_engine import wait_for as wait_for_within

CONFIG = EngineConfig(
    num_pages=32, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256, dtype="float32"
)


def spec_for(model_dir: Path) -> EngineSpec:
    return EngineSpec(model=str(model_dir), dtype="float32", config=CONFIG, torch_threads=1)


def start_engine(model_dir: Path) -> ProcessEngine:
    engine = ProcessEngine(spec_for(model_dir), load_tokenizer(str(model_dir))[0])
    engine.start()
    return engine


@pytest.fixture(scope="module")
def shared(tiny_llama_dir: Path) -> Iterator[ProcessEngine]:
    """One child for the tests that leave it healthy (spawning costs a few seconds)."""
    engine = start_engine(tiny_llama_dir)
    yield engine
    asyncio.run(engine.shutdown())


def request(rid: str, max_tokens: int = 6, prompt: list[int] | None = None) -> GenerateRequest:
    return greedy_request(rid, prompt or list(range(1, 11)), max_tokens)


async def wait_for(predicate: Callable[[], object]) -> None:
    await wait_for_within(predicate, timeout=20.0)  # the child answers between its steps


def reference_tokens(model_dir: Path, requests: list[GenerateRequest]) -> dict[str, list[int]]:
    engine = LLMEngine(load_model(str(model_dir), dtype=torch.float32), CONFIG)
    for req in requests:
        engine.add_request(req)
    tokens: dict[str, list[int]] = {req.request_id: [] for req in requests}
    while engine.has_unfinished:
        for output in engine.step():
            tokens[output.request_id] += output.token_ids
    return tokens


def test_concurrent_greedy_streams_match_the_in_process_engine(
    shared: ProcessEngine, tiny_llama_dir: Path
) -> None:
    requests = [request(f"r{i}", 4 + i, list(range(3 + i, 20 + 5 * i))) for i in range(5)]
    expected = reference_tokens(tiny_llama_dir, requests)

    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(collect(shared, req) for req in requests))

    for req, outputs in zip(requests, asyncio.run(main()), strict=True):
        assert [t for o in outputs for t in o.token_ids] == expected[req.request_id]
        assert outputs[-1].finished and outputs[-1].finish_reason == "length"
        assert outputs[-1].num_prompt_tokens == len(req.prompt_token_ids)
    assert shared.model_name == tiny_llama_dir.name
    assert shared.max_model_len == 256
    assert shared.num_unfinished == 0


def test_request_errors_cross_with_their_type_and_the_engine_keeps_serving(
    shared: ProcessEngine,
) -> None:
    async def main() -> None:
        with pytest.raises(InvalidRequestError) as empty:
            await collect(shared, GenerateRequest("empty", [], SamplingParams()))
        assert empty.value.param == "prompt"
        with pytest.raises(PromptTooLongError) as long:
            await collect(shared, request("long", max_tokens=300))
        assert long.value.param == "max_tokens" and "256" in str(long.value)
        stream = shared.generate(request("dup", max_tokens=200))
        await anext(stream)
        with pytest.raises(InvalidRequestError, match="already running"):
            await collect(shared, request("dup"))
        await stream.aclose()
        assert len(await collect(shared, request("after"))) == 6

    asyncio.run(main())


def test_aborts_and_cancelled_consumers_free_their_pages(shared: ProcessEngine) -> None:
    async def main() -> None:
        before = shared.stats().counters.num_aborted
        stream = shared.generate(request("early", max_tokens=200))
        async for _ in stream:
            break
        await stream.aclose()
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in shared.generate(request("cancelled", max_tokens=200)):
                started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 20.0)  # running: cancel it mid-stream
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        outputs: list[RequestOutput] = []
        async for output in shared.generate(request("explicit", max_tokens=200)):
            outputs.append(output)
            if len(outputs) == 2:
                shared.abort("explicit")
        assert outputs[-1].finish_reason == "abort" and len(outputs) < 200
        await wait_for(lambda: shared.num_unfinished == 0)
        await wait_for(lambda: shared.stats().counters.num_aborted >= before + 3)
        # Pages held by a finished request stay in the prefix cache, evictable: all available.
        await wait_for(lambda: shared.stats().num_pages_available == 32)

    asyncio.run(main())


def test_publish_and_unpublish_run_in_the_child(shared: ProcessEngine) -> None:
    async def main() -> None:
        published = await shared.publish_prefix(list(range(40, 80)))
        assert published.num_tokens == 40
        assert published.num_cached_tokens == 32  # two full 16-token pages
        await wait_for(lambda: shared.stats().num_pages_available == 30)  # pinned
        assert await shared.unpublish_prefix(list(range(40, 72))) == 32
        await wait_for(lambda: shared.stats().num_pages_available == 32)  # released
        assert await shared.unpublish_prefix(list(range(40, 72))) == 0

    asyncio.run(main())


def test_a_killed_child_fails_its_requests_and_refuses_new_ones(tiny_llama_dir: Path) -> None:
    engine = start_engine(tiny_llama_dir)

    async def main() -> None:
        stream = engine.generate(request("victim", max_tokens=200))
        assert not (await anext(stream)).finished
        assert engine.pid is not None
        os.kill(engine.pid, signal.SIGKILL)
        rest = [o async for o in stream]
        assert rest[-1].finish_reason == "error" and "exited" in (rest[-1].error or "")
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            await collect(engine, request("next"))
        await engine.shutdown()

    asyncio.run(main())


def test_shutdown_ends_the_child_and_later_requests_fail(tiny_llama_dir: Path) -> None:
    engine = start_engine(tiny_llama_dir)

    async def main() -> None:
        assert engine.is_running
        assert len(await collect(engine, request("one"))) == 6
        await engine.shutdown()
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            await collect(engine, request("late"))

    asyncio.run(main())
    assert engine._process is not None and engine._process.exitcode == 0


def test_a_model_that_cannot_load_fails_start(tiny_llama_dir: Path, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_llama_dir))[0]
    spec = EngineSpec(model=str(tmp_path / "missing"), dtype="float32", config=CONFIG)
    engine = ProcessEngine(spec, tokenizer)
    with pytest.raises(EngineError, match=r"failed to start.*not found"):
        engine.start()
    assert not engine.is_running


# A gateway whose engine child takes two minutes to load (its set-up sleeps before the model).
SLOW_LOADING_PARENT = """
import functools, sys, time
from engine.config import EngineConfig
from engine.factory import EngineSpec
from engine.model.loader import load_tokenizer
from engine.process_engine import ProcessEngine
config = EngineConfig(num_pages=32, max_num_batched_tokens=64, max_num_seqs=8, dtype="float32")
spec = EngineSpec(model=sys.argv[1], dtype="float32", config=config, torch_threads=1,
                  setup=functools.partial(time.sleep, 120))
ProcessEngine(spec, load_tokenizer(sys.argv[1])[0]).start()
"""


def _children(pid: int) -> list[int]:
    """Live (not zombie) processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
def test_a_child_still_loading_exits_when_its_parent_is_killed(tiny_llama_dir: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", SLOW_LOADING_PARENT, str(tiny_llama_dir)], start_new_session=True
    )
    children: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not children and time.monotonic() < deadline:
            time.sleep(0.1)
            children = _children(parent.pid)
        assert children, "the parent started no engine child"
        time.sleep(1.0)  # the child is in its set-up now, long before any pipe is read
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in children), "the engine child outlived its parent"
    finally:
        parent.kill()
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
