"""The load generator against a fake OpenAI SSE server on 127.0.0.1 (a few HTTP/1.1 lines)."""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from bench.loadgen import (
    RequestSpec,
    Target,
    poisson_offsets,
    run_chat_sessions,
    run_closed_loop,
    run_per_tenant,
    run_poisson,
    run_scheduled,
    send,
)


@dataclass
class FakeServer:
    """Streams ``max_tokens`` one-word chunks, then usage; key "bad" gets a 401."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    auth: list[str] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._respond(reader, writer)
        except ConnectionError:
            pass  # the client hung up (a request cut off at its run's deadline)
        finally:
            writer.close()  # also when the loop ends while a response is still streaming

    async def _respond(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        headers = dict(line.split(": ", 1) for line in head.split("\r\n")[1:] if ": " in line)
        lowered = {k.lower(): v for k, v in headers.items()}
        body = json.loads(await reader.readexactly(int(lowered["content-length"])))
        self.bodies.append(body)
        self.auth.append(lowered.get("authorization", ""))
        if lowered.get("authorization") == "Bearer bad":
            error = b'{"error": {"message": "bad key"}}'
            writer.write(b"HTTP/1.1 401 Unauthorized\r\nContent-Length: %d\r\n" % len(error))
            writer.write(b"Connection: close\r\n\r\n" + error)
            await writer.drain()
            writer.close()
            return
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        writer.write(b"Connection: close\r\n\r\n")
        for _ in range(body["max_tokens"]):
            await asyncio.sleep(0.005)
            chunk = {"choices": [{"index": 0, "text": " w", "finish_reason": None}]}
            writer.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await writer.drain()
        prompt_tokens = len(body["prompt"].split())
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": body["max_tokens"],
            "total_tokens": prompt_tokens + body["max_tokens"],
            "prompt_tokens_details": {"cached_tokens": prompt_tokens // 2},
        }
        writer.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        writer.write(b"data: [DONE]\n\n")
        await writer.drain()
        self.in_flight -= 1
        writer.close()


def serve(work: Callable[[Target, FakeServer], Awaitable[Any]], keys: dict[str, str]) -> Any:
    async def main() -> Any:
        fake = FakeServer()
        server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        target = Target(f"http://127.0.0.1:{port}", "m", keys, {"ignore_eos": True})
        async with server:
            return await work(target, fake), fake

    return asyncio.run(main())


def test_closed_loop_streams_every_request_within_the_concurrency() -> None:
    specs = [RequestSpec(f"t{i % 2}", "one two three four", 3) for i in range(6)]
    records, fake = serve(
        lambda target, _: run_closed_loop(target, specs, 2, 30), {"t0": "k0", "t1": "k1"}
    )
    assert len(records) == 6
    assert all(r.ok for r in records)
    assert all(len(r.token_times) == 3 and r.completion_tokens == 3 for r in records)
    assert all(r.prompt_tokens == 4 and r.cached_tokens == 2 for r in records)
    assert all(0 < r.ttft <= r.latency for r in records)
    assert fake.max_in_flight <= 2
    assert sorted(set(fake.auth)) == ["Bearer k0", "Bearer k1"]
    body = fake.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0


def test_http_errors_are_recorded_not_raised() -> None:
    specs = [RequestSpec("t0", "x", 2), RequestSpec("t1", "x", 2)]
    records, _ = serve(lambda t, _: run_closed_loop(t, specs, 2, 30), {"t0": "bad"})
    by_tenant = {r.tenant: r for r in records}
    assert by_tenant["t0"].error is not None and by_tenant["t0"].error.startswith("HTTP 401")
    assert by_tenant["t1"].ok


def test_poisson_and_per_tenant_loops_send_everything() -> None:
    specs = [RequestSpec("t0", "a b", 2) for _ in range(5)]
    records, _ = serve(lambda t, _: run_poisson(t, specs, rate=200.0, seed=1), {})
    assert len(records) == 5 and all(r.ok for r in records)
    by_tenant = {"t0": specs[:4], "t1": [RequestSpec("t1", "c", 1)]}
    records, fake = serve(lambda t, _: run_per_tenant(t, by_tenant, {"t0": 4, "t1": 1}, 30), {})
    assert sorted(r.tenant for r in records) == ["t0"] * 4 + ["t1"]
    assert fake.auth == [""] * 5  # no keys: no Authorization header


def test_chat_sessions_grow_their_history_with_each_answer() -> None:
    sessions = [("t0", ["hello there", " next"])]
    records, fake = serve(lambda t, _: run_chat_sessions(t, sessions, 2, 30), {})
    assert len(records) == 2
    assert [b["prompt"] for b in fake.bodies] == ["hello there", "hello there w w next"]


def test_the_target_must_be_loopback() -> None:
    with pytest.raises(ValueError, match="loopback"):
        Target("http://10.0.0.1:8000", "m")


def test_requests_running_at_the_deadline_are_cut_off_and_recorded() -> None:
    """400 tokens at 5 ms each take 2 s; a 0.3 s run ends on time with what it has."""
    specs = [RequestSpec("t0", "a b", 400) for _ in range(5)]

    async def timed(run: Awaitable[Any]) -> tuple[Any, float]:
        started = asyncio.get_running_loop().time()
        result = await run
        return result, asyncio.get_running_loop().time() - started

    for loop in (
        lambda t: run_closed_loop(t, specs, 2, 0.3),
        lambda t: run_poisson(t, specs, rate=1000.0, deadline_s=0.3),
        lambda t: run_chat_sessions(t, [("t0", ["hi", " again"])], 400, 0.3),
    ):
        (records, seconds), _ = serve(lambda t, _, loop=loop: timed(loop(t)), {})
        assert seconds < 1.5
        assert records and all(r.error is not None and "deadline" in r.error for r in records)
        assert any(0 < len(r.token_times) < 400 for r in records)  # what had arrived is kept


def test_a_seed_gives_the_same_poisson_schedule_every_time() -> None:
    offsets = poisson_offsets(2.0, 600.0, seed=7)
    assert offsets == poisson_offsets(2.0, 600.0, seed=7)
    assert offsets != poisson_offsets(2.0, 600.0, seed=8)
    assert offsets == sorted(offsets) and offsets[0] > 0 and offsets[-1] < 600.0
    assert len(offsets) == pytest.approx(1200, rel=0.1)  # the rate, over a long window
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert statistics.mean(gaps) == pytest.approx(0.5, rel=0.1)
    assert statistics.stdev(gaps) == pytest.approx(0.5, rel=0.15)  # exponential: sd = mean
    with pytest.raises(ValueError, match="positive"):
        poisson_offsets(0.0, 10.0, seed=1)


def test_a_schedule_sends_at_its_times_without_waiting_for_answers() -> None:
    """Requests of 40 tokens take ~0.2 s each; sent every 0.05 s, several are soon in flight."""
    offsets = [0.05 * i for i in range(6)]
    specs = [RequestSpec("t0", "a b", 40) for _ in offsets]

    def run(target: Target) -> Awaitable[list[Any]]:
        async def one(client: Any, spec: RequestSpec, stop_at: float) -> list[Any]:
            return [await send(client, target, spec, stop_at=stop_at)]

        return run_scheduled(specs, offsets, one, 30.0)

    records, fake = serve(lambda t, _: run(t), {})
    assert len(records) == 6 and all(r.ok for r in records)
    sent = sorted(r.sent_at for r in records)
    for at, offset in zip(sent, offsets, strict=True):
        assert at - sent[0] == pytest.approx(offset, abs=0.04)
    assert fake.max_in_flight >= 3
