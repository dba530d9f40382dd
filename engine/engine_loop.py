"""The one step loop, on a thread or in a child process: apply commands, step, report.

Where it runs decides only where commands come from (``Inbox``: a queue or a pipe) and where
results go (``Outbox``: sinks on this thread, or reports down a pipe). Mutation: the loop is
the only caller of its ``LLMEngine``.
"""

from __future__ import annotations

import time
from typing import Protocol

import structlog

from engine.commands import Abort, Add, Command, Drop, Stop
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.stats import EngineSnapshot

log = structlog.get_logger(__name__)
SNAPSHOT_INTERVAL_S = 0.1  # between two snapshots while the engine is busy


class Inbox(Protocol):
    def get(self, timeout: float | None) -> Command | None:
        """The next command; None if none came within ``timeout`` seconds (None: wait)."""
        ...


class Outbox(Protocol):
    def reject(self, request_id: str, exc: Exception) -> None:
        """``Add`` could not queue the request; the error is that request's alone."""
        ...

    def report(self, outputs: list[RequestOutput], snapshot: EngineSnapshot | None) -> None:
        """A step's outputs (maybe none) and, every ``SNAPSHOT_INTERVAL_S`` or when idle, a
        fresh snapshot."""
        ...


class EngineLoop:
    """Blocks on its inbox while idle and drains it between steps; on ``Stop`` it aborts what
    is left and reports those last outputs. When work reaches an idle engine and the request
    says more are following (``GenerateRequest.num_following``), it takes those too, for up to
    ``gather_s``, so that the first step runs them together."""

    def __init__(
        self, engine: LLMEngine, inbox: Inbox, outbox: Outbox, gather_s: float = 0.0
    ) -> None:
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.gather_s = gather_s
        self.snapshot_at = 0.0
        self.following = 0  # requests the last one said are on their way

    def run(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_unfinished:
                self._report([], force_snapshot=True)
                if not self._apply(self.inbox.get(None)) or not self._gather():
                    break
            if not self._drain():
                break
            self._report(engine.step() if engine.has_unfinished else [], force_snapshot=False)
        engine.abort_all()
        self._report(engine.step(), force_snapshot=True)

    def _gather(self) -> bool:
        """Take the rest of a burst as it comes, for up to ``gather_s``; False means stop."""
        deadline = time.monotonic() + self.gather_s
        while self.following > 0:
            left = deadline - time.monotonic()
            command = self.inbox.get(left) if left > 0 else None
            if command is None:
                break
            if not self._apply(command):
                return False
        self.following = 0
        return True

    def _drain(self) -> bool:
        """Apply every command waiting; False means stop."""
        while (command := self.inbox.get(0.0)) is not None:
            if not self._apply(command):
                return False
        return True

    def _apply(self, command: Command | None) -> bool:
        """Apply one command; False means stop."""
        match command:
            case Stop():
                return False
            case Abort(request_id=request_id):
                self.engine.abort(request_id)
            case Drop(tenant_id=tenant_id):
                freed = self.engine.drop_tenant(tenant_id)
                log.info("tenant_cache_dropped", tenant_id=tenant_id, pages=freed)
            case Add(request=request):
                self.following = request.num_following
                try:
                    self.engine.add_request(request)
                except Exception as exc:  # the request's own failure, never the loop's
                    self.outbox.reject(request.request_id, exc)
        return True

    def _report(self, outputs: list[RequestOutput], force_snapshot: bool) -> None:
        now = time.monotonic()
        snapshot = None
        if force_snapshot or now - self.snapshot_at >= SNAPSHOT_INTERVAL_S:
            snapshot = self.engine.snapshot()
            self.snapshot_at = now
        self.outbox.report(outputs, snapshot)
