"""The engine loop's gathering of a burst (as the child runs it): an idle engine takes the
requests said to follow."""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

from engine.commands import Add, Channel, Stop
from engine.engine_loop import EngineLoop
from engine.outputs import GenerateRequest
from engine.process_engine import GATHER_S, _PipeInbox, _PipeOutbox
from engine.sampling_params import SamplingParams


class RecordingEngine:
    """Stands in for LLMEngine: records what the loop hands it."""

    def __init__(self) -> None:
        self.added: list[str] = []

    def add_request(self, request: GenerateRequest) -> None:
        self.added.append(request.request_id)


def add(request_id: str, following: int) -> Add:
    params = SamplingParams(max_tokens=1, temperature=0.0)
    return Add(GenerateRequest(request_id, [1, 2], params, num_following=following))


def loop_with_pipe() -> tuple[EngineLoop, RecordingEngine, Any]:
    """The child's loop over a real pipe; the returned channel sends it typed commands."""
    receive, send = multiprocessing.Pipe(duplex=False)
    engine = RecordingEngine()
    results, _ = multiprocessing.Pipe(duplex=False)
    inbox, outbox = _PipeInbox(Channel(receive)), _PipeOutbox(Channel(results))
    return EngineLoop(engine, inbox, outbox, GATHER_S), engine, Channel(send)  # type: ignore[arg-type]


def recv(loop: EngineLoop) -> Any:
    return loop.inbox.get(None)


def test_the_requests_said_to_follow_are_taken_before_the_first_step() -> None:
    loop, engine, send = loop_with_pipe()
    send.send(add("a", 2))
    assert loop._apply(recv(loop))

    def later() -> None:
        time.sleep(GATHER_S / 10)
        send.send(add("b", 1))
        time.sleep(GATHER_S / 10)
        send.send(add("c", 0))
        send.send(add("d", 0))  # after the burst: left for the loop's next drain

    threading.Thread(target=later).start()
    started = time.monotonic()
    assert loop._gather()
    assert engine.added == ["a", "b", "c"]
    assert time.monotonic() - started < GATHER_S
    assert loop.inbox.channel.poll(1.0)  # type: ignore[attr-defined]  # "d" is still in the pipe


def test_a_lone_request_starts_at_once_and_a_short_burst_waits_at_most_gather_s() -> None:
    loop, engine, send = loop_with_pipe()
    send.send(add("alone", 0))
    assert loop._apply(recv(loop))
    started = time.monotonic()
    assert loop._gather()
    assert time.monotonic() - started < GATHER_S / 5
    # Five said to follow, one comes (the others were refused at the gateway, say).
    send.send(add("first", 5))
    send.send(add("second", 4))
    assert loop._apply(recv(loop))
    started = time.monotonic()
    assert loop._gather()
    waited = time.monotonic() - started
    assert GATHER_S * 0.9 <= waited < GATHER_S + 0.5
    assert engine.added == ["alone", "first", "second"]
    assert loop.following == 0


def test_a_stop_while_gathering_ends_the_loop() -> None:
    loop, engine, send = loop_with_pipe()
    send.send(add("a", 3))
    send.send(Stop())
    assert loop._apply(recv(loop))
    assert not loop._gather()
    assert engine.added == ["a"]
