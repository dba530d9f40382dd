"""The step loop in a child process, so the model's kernels never wait on the gateway's GIL.

The parent keeps the tokenizer and one sink per live request; the child owns the model, the KV
cache and the ``LLMEngine``. Two one-way pipes join them:

- parent → child: ``("add", GenerateRequest)``, ``("abort", request_id)``, ``("stop",)``; a
  sender thread writes them, so a full pipe never blocks the event loop.
- child → parent: ``("ready", name, max_model_len, snapshot)`` once, then per step
  ``("step", outputs, errors, snapshot | None)``, and finally ``("stopped", snapshot)``,
  ``("dead", reason)`` or ``("failed", reason)`` (the model did not load). A reader thread
  hands each output to its request's sink.

The child blocks on its pipe when it has no work and drains it between steps; when work arrives
at an idle child and the request says more are following, it takes those too (up to
``GATHER_S``) before its first step. It ignores SIGINT
and SIGTERM (the parent drains first, then sends ``stop``) and exits when the parent's end of
the pipe closes, so it never outlives the gateway.
"""

from __future__ import annotations

import multiprocessing
import queue
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import structlog

from engine.async_engine import SNAPSHOT_INTERVAL_S, EngineClient, Sink
from engine.errors import EngineDeadError, EngineError, InvalidRequestError, PromptTooLongError
from engine.factory import EngineSpec, build_engine
from engine.heap import freeze_startup
from engine.llm_engine import LLMEngine
from engine.load_progress import progress_for
from engine.lora.adapter import AdapterError
from engine.outputs import GenerateRequest, RequestOutput
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


def _child_main(spec: EngineSpec, commands: Connection, results: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if spec.setup is not None:
        spec.setup()
    progress = progress_for()  # this child shares the parent's stderr: bars if a terminal
    try:
        engine, name = build_engine(spec, progress)
    except Exception as exc:  # a bad path or a broken file: the parent reports it
        results.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    finally:
        progress.close()
    freeze_startup()  # the loaded model is never garbage: full collections skip it
    results.send(("ready", name, engine.max_model_len, engine.snapshot()))
    try:
        _ChildLoop(engine, commands, results).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the parent is gone: nobody to serve
    except BaseException as exc:
        log.exception("engine_loop_died")
        results.send(("dead", repr(exc)))


class _ChildLoop:
    def __init__(self, engine: LLMEngine, commands: Connection, results: Connection) -> None:
        self.engine = engine
        self.commands = commands
        self.results = results
        self.errors: list[tuple[str, str, str, str | None]] = []
        self.snapshot_at = 0.0
        self.following = 0  # requests the last one said are on their way

    def run(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_unfinished:
                self._send([], force_snapshot=True)
                if not self._apply(self.commands.recv()):  # idle: block until work comes
                    break
                if not self._gather():
                    break
            stop = False
            while not stop and self.commands.poll():
                stop = not self._apply(self.commands.recv())
            if stop:
                break
            self._send(engine.step() if engine.has_unfinished else [], force_snapshot=False)
        engine.abort_all()
        outputs = engine.step()
        self._send(outputs, force_snapshot=False)
        self.results.send(("stopped", engine.snapshot()))

    def _gather(self) -> bool:
        """Work just arrived at an idle engine: while the latest request says more are on their
        way, take them as they come, for up to GATHER_S, so that the first step runs them
        together rather than one prompt alone while the rest queue behind it. False means
        stop."""
        deadline = time.monotonic() + GATHER_S
        while self.following > 0:
            left = deadline - time.monotonic()
            if left <= 0 or not self.commands.poll(left):
                break
            if not self._apply(self.commands.recv()):
                return False
        self.following = 0
        return True

    def _apply(self, command: tuple[Any, ...]) -> bool:
        """Apply one command; False means stop."""
        kind = command[0]
        if kind == "stop":
            return False
        if kind == "abort":
            self.engine.abort(command[1])
            return True
        if kind == "drop":
            freed = self.engine.drop_tenant(command[1])
            log.info("tenant_cache_dropped", tenant_id=command[1], pages=freed)
            return True
        request: GenerateRequest = command[1]
        self.following = request.num_following
        try:
            self.engine.add_request(request)
        except EngineError as exc:
            param = getattr(exc, "param", None)
            self.errors.append((request.request_id, exc.code, str(exc), param))
        except Exception as exc:  # the request's own failure, never the loop's
            self.errors.append((request.request_id, EngineError.code, repr(exc), None))
        return True

    def _send(self, outputs: list[RequestOutput], force_snapshot: bool) -> None:
        now = time.monotonic()
        snapshot = None
        if force_snapshot or now - self.snapshot_at >= SNAPSHOT_INTERVAL_S:
            snapshot = self.engine.snapshot()
            self.snapshot_at = now
        if outputs or self.errors or snapshot is not None:
            self.results.send(("step", outputs, self.errors, snapshot))
            self.errors = []


# -- the parent ---------------------------------------------------------------------------------


class ProcessEngine(EngineClient):
    """An ``EngineClient`` whose ``LLMEngine`` runs in a child process (spawned, not forked)."""

    def __init__(self, spec: EngineSpec, tokenizer: Tokenizer) -> None:
        self.spec = spec
        self._tokenizer = tokenizer
        self.model_name = ""
        self.max_model_len = 0
        self._process: multiprocessing.process.BaseProcess | None = None
        self._commands: Connection | None = None  # parent's write end
        self._results: Connection | None = None  # parent's read end
        self._outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._lock = threading.Lock()  # guards _sinks, _dead and _stopping
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
        child_commands, self._commands = context.Pipe(duplex=False)
        self._results, child_results = context.Pipe(duplex=False)
        process = context.Process(
            target=_child_main,
            args=(self.spec, child_commands, child_results),
            name="atrium-engine",
            daemon=True,
        )
        process.start()
        self._process = process
        child_commands.close()
        child_results.close()
        message = self._wait_ready(process)
        if message[0] != "ready":
            self._dead = f"the engine process failed to start: {message[1]}"
            process.join(10)
            raise EngineError(self._dead)
        _, self.model_name, self.max_model_len, self._snapshot = message
        for target, name in ((self._read, "reader"), (self._write, "sender")):
            thread = threading.Thread(target=target, name=f"atrium-engine-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("engine_process_started", pid=process.pid, model=self.model_name)

    def _wait_ready(self, process: multiprocessing.process.BaseProcess) -> tuple[Any, ...]:
        results = self._results
        assert results is not None
        while not results.poll(0.2):
            if not process.is_alive():
                return ("failed", f"exit code {process.exitcode}")
        try:
            message: tuple[Any, ...] = results.recv()
        except EOFError:
            return ("failed", f"exit code {process.exitcode}")
        return message

    async def shutdown(self) -> None:
        """Abort what is left, stop the child and wait for it to exit."""
        import asyncio

        if self._process is None:
            return
        with self._lock:
            self._stopping = True
        self._outbox.put(("stop",))
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
        request_id = request.request_id
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine loop stopped: {self._dead}")
            if self._process is None or self._stopping:
                raise EngineDeadError("the engine loop is not running")
            if request_id in self._sinks:
                raise InvalidRequestError(f"request id {request_id!r} is already running")
            self._sinks[request_id] = sink
        self._outbox.put(("add", request))

    def abort(self, request_id: str) -> None:
        if self._dead is None:
            self._outbox.put(("abort", request_id))

    def drop_tenant(self, tenant_id: str) -> None:
        if self._dead is None:
            self._outbox.put(("drop", tenant_id))

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
                message = results.recv()
                kind = message[0]
                if kind == "step":
                    self._deliver(message[1], message[2], message[3])
                elif kind == "stopped":
                    self._snapshot = message[1]
                    reason = "the engine was shut down"
                    break
                elif kind == "dead":
                    reason = message[1]
                    log.error("engine_process_died", error=reason)
                    break
        except (EOFError, OSError):
            process = self._process
            code = None if process is None else process.exitcode
            log.error("engine_process_lost", exit_code=code)
            reason = f"the engine process exited (code {code})"
        self._die(reason)

    def _deliver(
        self,
        outputs: list[RequestOutput],
        errors: list[tuple[str, str, str, str | None]],
        snapshot: EngineSnapshot | None,
    ) -> None:
        if snapshot is not None:
            self._snapshot = snapshot
        for request_id, code, message, param in errors:
            with self._lock:
                sink = self._sinks.pop(request_id, None)
            if sink is not None:
                error_type = _ERRORS.get(code)
                sink(EngineError(message) if error_type is None else error_type(message, param))
        for output in outputs:
            with self._lock:
                sinks = self._sinks
                sink = sinks.pop(output.request_id, None) if output.finished else None
                sink = sink or sinks.get(output.request_id)
            if sink is not None:
                sink(output)

    def _die(self, reason: str) -> None:
        with self._lock:
            self._dead = reason
            sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            sink(RequestOutput(request_id, finished=True, finish_reason="error", error=reason))
        self._outbox.put(None)
