"""The database monitor: outages need failures in a row, readiness never probes, hooks run."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import exc

from web.tenancy.db_monitor import DatabaseMonitor, DegradedMetrics

FAST = {"sweep_interval_s": 0.01, "backoff_initial_s": 0.01, "backoff_max_s": 0.02}


class ScriptedProbe:
    """Answers from a script, then ``answer``; counts its calls and remembers its answers."""

    def __init__(self, *script: bool, then: bool = True) -> None:
        self.script = list(script)
        self.answer = then
        self.given: list[bool] = []

    @property
    def calls(self) -> int:
        return len(self.given)

    async def __call__(self, timeout_s: float) -> bool:
        self.given.append(self.script.pop(0) if self.script else self.answer)
        return self.given[-1]


def monitor_with(probe: ScriptedProbe, **options: float) -> tuple[DatabaseMonitor, DegradedMetrics]:
    metrics = DegradedMetrics(CollectorRegistry())
    return DatabaseMonitor(probe, metrics, **(FAST | options)), metrics  # type: ignore[arg-type]


async def until(condition: Callable[[], bool], timeout_s: float = 2.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())


def test_one_failed_probe_does_not_start_an_outage() -> None:
    async def body() -> None:
        probe = ScriptedProbe(False, True, False, False, True, False)
        monitor, metrics = monitor_with(probe)
        monitor.start()
        try:
            await until(lambda: probe.calls >= 6)
            assert not monitor.down and monitor.outages == 0
            assert metrics.database_up._value.get() == 1
        finally:
            await monitor.stop()

    run(body)


def test_failures_in_a_row_start_an_outage_and_a_good_probe_ends_it() -> None:
    async def body() -> None:
        probe = ScriptedProbe(True, False, False, then=False)
        monitor, metrics = monitor_with(probe)
        recovered: list[int] = []

        async def hook() -> None:
            recovered.append(monitor.outages)

        monitor.recovery_hooks.append(hook)
        monitor.start()
        try:
            await until(lambda: monitor.down)
            assert probe.given[:4] == [True, False, False, False] and monitor.outages == 1
            assert metrics.database_up._value.get() == 0
            assert not await monitor.check()
            probe.answer = True
            await until(lambda: not monitor.down)
            assert recovered == [1] and await monitor.check()
            assert metrics.database_up._value.get() == 1 and monitor.failed_probes == 0
        finally:
            await monitor.stop()

    run(body)


def test_readiness_answers_from_the_last_state_without_probing() -> None:
    async def body() -> None:
        probe = ScriptedProbe(then=False)
        monitor, _ = monitor_with(probe, failures_to_degrade=1)
        assert all([await monitor.check() for _ in range(50)])
        assert probe.calls == 0  # /readyz is no lever on the database
        monitor.report(exc.OperationalError("SELECT 1", {}, Exception("unable to open")))
        assert monitor.down and not await monitor.check()
        assert probe.calls == 0

    run(body)


@pytest.mark.parametrize(
    ("error", "unavailable"),
    [
        (exc.OperationalError("SELECT 1", {}, Exception("database is locked")), True),
        (ConnectionRefusedError(), True),
        (exc.OperationalError("SELECT x", {}, Exception("no such column: x")), False),
        (exc.TimeoutError("pool exhausted"), False),
        (ValueError("a bug"), False),
    ],
)
def test_a_failing_call_reports_an_outage_only_when_unreachable(
    error: BaseException, unavailable: bool
) -> None:
    async def body() -> None:
        monitor, _ = monitor_with(ScriptedProbe())
        assert monitor.report(error) is unavailable
        assert monitor.down is unavailable

    run(body)


def test_sweeps_run_while_up_and_stop_during_an_outage() -> None:
    async def body() -> None:
        probe = ScriptedProbe()
        monitor, _ = monitor_with(probe, backoff_initial_s=10.0, backoff_max_s=10.0)
        sweeps: list[bool] = []

        async def sweep() -> None:
            sweeps.append(monitor.down)

        monitor.sweep = sweep
        monitor.start()
        try:
            await until(lambda: len(sweeps) >= 3)
            monitor.report(ConnectionRefusedError())
            count = len(sweeps)
            await asyncio.sleep(0.1)
            assert len(sweeps) <= count + 1 and not any(sweeps)
        finally:
            await monitor.stop()

    run(body)


@pytest.mark.parametrize(
    "failure",
    [ValueError("a bug in the settle retry"), ConnectionRefusedError()],
    ids=["bug", "unreachable-again"],
)
def test_every_recovery_hook_runs_even_when_one_before_it_fails(failure: Exception) -> None:
    async def body() -> None:
        probe = ScriptedProbe(then=False)
        monitor, _ = monitor_with(probe, failures_to_degrade=1)
        ran: list[str] = []

        async def failing() -> None:
            ran.append("settles")
            raise failure

        down_at_flush: list[bool] = []

        async def flush() -> None:
            ran.append("flush")
            down_at_flush.append(monitor.down)

        monitor.recovery_hooks += [failing, flush]
        monitor.report(ConnectionRefusedError())
        monitor.start()
        try:
            probe.answer = True
            await until(lambda: "flush" in ran)
            assert ran[:2] == ["settles", "flush"]
            # A hook that found the database gone again starts the next outage.
            assert down_at_flush[0] is isinstance(failure, ConnectionRefusedError)
        finally:
            await monitor.stop()

    run(body)
