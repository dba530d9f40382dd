"""The step loop in a child process, so the model's kernels never wait on the gateway's GIL.

The parent keeps the tokenizer and one sink per live request; the child owns the model, the KV
cache and the ``LLMEngine``, and runs the same ``EngineLoop`` an in-process engine runs. Two
one-way pipes join them, each carrying the typed messages of ``engine/commands.py`` as msgpack:

- parent → child: ``Add``, ``Abort``, ``Drop``, ``Stop``; a sender thread writes them, so a
  full pipe never blocks the event loop.
- child → parent: ``Ready`` once, then ``Step`` (outputs, refused requests, maybe a snapshot)
  per step, and finally ``Stopped``, ``Dead`` or ``Failed`` (the model did not load). A reader
  thread hands each output to its request's sink.

When work arrives at an idle child and the request says more are following, the loop takes
those too (up to ``GATHER_S``) before its first step. The child ignores SIGINT and SIGTERM (the
parent drains first, then sends ``Stop``) and exits when the parent's end of the pipe closes, so
it never outlives the gateway.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import signal
import threading
import time
from multiprocessing.connection import Connection

import structlog

from engine.async_engine import EngineClient
from engine.commands import (
    Abort,
    Add,
    Channel,
    Command,
    Dead,
    Drop,
    Failed,
    Ready,
    Rejected,
    Report,
    Step,
    Stop,
    Stopped,
)
from engine.engine_loop import EngineLoop
from engine.errors import EngineDeadError, EngineError, InvalidRequestError, PromptTooLongError
from engine.factory import EngineSpec, build_engine
from engine.heap import freeze_startup
from engine.load_progress import progress_for
from engine.lora.adapter import AdapterError
from engine.outputs import GenerateRequest, RequestOutput
from engine.sinks import Sink, Sinks
from engine.stats import EngineSnapshot
from engine.tokenizer import Tokenizer

log = structlog.get_logger(__name__)
# The longest an idle engine waits for the rest of a burst (GenerateRequest.num_following).
GATHER_S = 0.05

_ERRORS: dict[str, type[EngineError]] = {
    PromptTooLongError.code: PromptTooLongError,
    InvalidRequestError.code: InvalidRequestError,
    AdapterError.code: AdapterError,
}


# -- the child ----------------------------------------------------------------------------------

PARENT_POLL_S = 0.5  # how often the child looks for its parent while nothing else would notice


def _exit_with_parent(parent: int) -> None:
    """End this process when ``parent`` (the process that started it) is gone: a parent killed
    while the model loads (minutes for a large one) closes no pipe that the child is reading
    yet. A thread polls the parent's pid (a child whose parent died is handed to another
    process), from the first thing the child does, so one orphaned even sooner exits too."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="atrium-engine-parent-watch", daemon=True).start()


def _child_main(spec: EngineSpec, commands: Connection, results: Connection, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_parent(parent)
    if spec.setup is not None:
        spec.setup()
    reports = Channel(results)
    progress = progress_for()  # this child shares the parent's stderr: bars if a terminal
    try:
        engine, name = build_engine(spec, progress)
    except Exception as exc:  # a bad path or a broken file: the parent reports it
        reports.send(Failed(f"{type(exc).__name__}: {exc}"))
        return
    finally:
        progress.close()
    freeze_startup()  # the loaded model is never garbage: full collections skip it
    reports.send(Ready(name, engine.max_model_len, engine.snapshot()))
    try:
        EngineLoop(engine, _PipeInbox(Channel(commands)), _PipeOutbox(reports), GATHER_S).run()
        reports.send(Stopped(engine.snapshot()))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the parent is gone: nobody to serve
    except BaseException as exc:
        log.exception("engine_loop_died")
        reports.send(Dead(repr(exc)))


class _PipeInbox:
    """The loop's commands from the parent's pipe."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def get(self, timeout: float | None) -> Command | None:
        if timeout is not None and not self.channel.poll(timeout):
            return None
        return self.channel.recv_command()


class _PipeOutbox:
    """The loop's results down the pipe to the parent: a ``Step`` whenever there is news."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.rejected: list[Rejected] = []

    def reject(self, request_id: str, exc: Exception) -> None:
        if isinstance(exc, EngineError):
            param = getattr(exc, "param", None)
            self.rejected.append(Rejected(request_id, exc.code, str(exc), param))
        else:
            self.rejected.append(Rejected(request_id, EngineError.code, repr(exc)))

    def report(self, outputs: list[RequestOutput], snapshot: EngineSnapshot | None) -> None:
        if outputs or self.rejected or snapshot is not None:
            self.channel.send(Step(outputs, self.rejected, snapshot))
            self.rejected = []


# -- the parent ---------------------------------------------------------------------------------


class ProcessEngine(EngineClient):
    """An ``EngineClient`` whose ``LLMEngine`` runs in a child process (spawned, not forked)."""

    def __init__(self, spec: EngineSpec, tokenizer: Tokenizer) -> None:
        self.spec = spec
        self._tokenizer = tokenizer
        self.model_name = ""
        self.max_model_len = 0
        self._process: multiprocessing.process.BaseProcess | None = None
        self._commands: Channel | None = None  # parent's write end
        self._results: Channel | None = None  # parent's read end
        self._outbox: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._sinks = Sinks()
        self._lock = threading.Lock()  # orders _dead and _stopping against queueing a request
        self._dead: str | None = None
        self._stopping = False
        self._snapshot = EngineSnapshot()
        self._threads: list[threading.Thread] = []

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn the child and wait until its model is loaded; raises EngineError if it fails."""
        if self._process is not None:
            raise RuntimeError("the engine process is already started")
        context = multiprocessing.get_context("spawn")
        child_commands, commands = context.Pipe(duplex=False)
        results, child_results = context.Pipe(duplex=False)
        self._commands, self._results = Channel(commands), Channel(results)
        process = context.Process(
            target=_child_main,
            args=(self.spec, child_commands, child_results, os.getpid()),
            name="atrium-engine",
            daemon=True,
        )
        process.start()
        self._process = process
        child_commands.close()
        child_results.close()
        report = self._wait_ready(process, self._results)
        if not isinstance(report, Ready):
            reason = report.reason if isinstance(report, Failed | Dead) else repr(report)
            self._dead = f"the engine process failed to start: {reason}"
            process.join(10)
            raise EngineError(self._dead)
        self.model_name, self.max_model_len = report.model_name, report.max_model_len
        self._snapshot = report.snapshot
        for target, name in ((self._read, "reader"), (self._write, "sender")):
            thread = threading.Thread(target=target, name=f"atrium-engine-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("engine_process_started", pid=process.pid, model=self.model_name)

    @staticmethod
    def _wait_ready(process: multiprocessing.process.BaseProcess, results: Channel) -> Report:
        while not results.poll(0.2):
            if not process.is_alive():
                return Failed(f"exit code {process.exitcode}")
        try:
            return results.recv_report()
        except EOFError:
            return Failed(f"exit code {process.exitcode}")

    async def shutdown(self) -> None:
        """Abort what is left, stop the child and wait for it to exit."""
        if self._process is None:
            return
        with self._lock:
            self._stopping = True
        self._outbox.put(Stop())
        await asyncio.to_thread(self._join)

    def _join(self, grace_s: float = 30.0) -> None:
        process = self._process
        assert process is not None
        reader = self._threads[0] if self._threads else None
        if reader is not None:
            reader.join(grace_s)  # until the child's last message
        self._outbox.put(None)
        process.join(grace_s)
        if process.is_alive():
            process.kill()
            process.join(5)
        for thread in self._threads:
            thread.join(5)

    @property
    def is_running(self) -> bool:
        process = self._process
        return process is not None and process.is_alive() and self._dead is None

    @property
    def num_unfinished(self) -> int:
        return len(self._sinks)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def stats(self) -> EngineSnapshot:
        return self._snapshot

    # -- requests -----------------------------------------------------------------------------

    def _submit(self, request: GenerateRequest, sink: Sink) -> None:
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine loop stopped: {self._dead}")
            if self._process is None or self._stopping:
                raise EngineDeadError("the engine loop is not running")
            self._sinks.add(request.request_id, sink)
        self._outbox.put(Add(request))

    def abort(self, request_id: str) -> None:
        if self._dead is None:
            self._outbox.put(Abort(request_id))

    def drop_tenant(self, tenant_id: str) -> None:
        if self._dead is None:
            self._outbox.put(Drop(tenant_id))

    # -- the two threads ----------------------------------------------------------------------

    def _write(self) -> None:
        commands = self._commands
        assert commands is not None
        while True:
            command = self._outbox.get()
            if command is None:
                break
            try:
                commands.send(command)
            except OSError:  # the child is gone; the reader reports it
                break
        commands.close()

    def _read(self) -> None:
        results = self._results
        assert results is not None
        reason = "the engine process exited"
        try:
            while True:
                report = results.recv_report()
                if isinstance(report, Step):
                    self._deliver(report)
                elif isinstance(report, Stopped):
                    self._snapshot = report.snapshot
                    reason = "the engine was shut down"
                    break
                elif isinstance(report, Dead):
                    reason = report.reason
                    log.error("engine_process_died", error=reason)
                    break
        except (EOFError, OSError):
            process = self._process
            code = None if process is None else process.exitcode
            log.error("engine_process_lost", exit_code=code)
            reason = f"the engine process exited (code {code})"
        self._die(reason)

    def _deliver(self, step: Step) -> None:
        if step.snapshot is not None:
            self._snapshot = step.snapshot
        for rejected in step.rejected:
            error_type = _ERRORS.get(rejected.code)
            message, param = rejected.message, rejected.param
            error = EngineError(message) if error_type is None else error_type(message, param)
            self._sinks.fail(rejected.request_id, error)
        self._sinks.deliver(step.outputs)

    def _die(self, reason: str) -> None:
        with self._lock:
            self._dead = reason
        self._sinks.end_all(reason)
        self._outbox.put(None)
