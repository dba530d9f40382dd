"""The asyncio front of the engine: the step loop on its own thread, outputs on asyncio queues.

``EngineClient`` is what the gateway talks to: ``generate`` streams a request's outputs,
``abort`` stops one, ``stats`` returns the latest snapshot. ``AsyncEngine`` runs the step loop
on a thread of this process; ``engine.process_engine.ProcessEngine`` runs it in a child process.
Requests and aborts cross to the engine thread through a thread-safe queue; outputs come back
with ``loop.call_soon_threadsafe``. The loop blocks on the queue when idle (no busy-waiting).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

import structlog

from engine.errors import EngineDeadError, EngineError, InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.outputs import GenerateRequest, PublishedPrefix, RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineSnapshot
from engine.tokenizer import Tokenizer
from radix_cache.prefix_cache import PUBLIC_NAMESPACE

log = structlog.get_logger(__name__)

Sink = Callable[[RequestOutput | BaseException], None]
SNAPSHOT_INTERVAL_S = 0.1


@dataclass(slots=True)
class _Add:
    request: GenerateRequest
    sink: Sink


@dataclass(slots=True)
class _Abort:
    request_id: str


class _Stop:
    __slots__ = ()


@dataclass(slots=True)
class _Drop:
    tenant_id: str


class EngineClient(ABC):
    """The engine as the event loop sees it, wherever its step loop runs."""

    @abstractmethod
    def start(self) -> None:
        """Start the step loop (blocks until the engine is ready to take requests)."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Abort what is left and stop the step loop."""

    @property
    @abstractmethod
    def is_running(self) -> bool: ...

    @property
    @abstractmethod
    def num_unfinished(self) -> int: ...

    @property
    @abstractmethod
    def tokenizer(self) -> Tokenizer: ...

    @abstractmethod
    def stats(self) -> EngineSnapshot:
        """The latest snapshot taken by the step loop (immutable, safe to read anywhere)."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Ask the loop to stop a request; its pages are freed at the next step."""

    def drop_tenant(self, tenant_id: str) -> None:
        """Free the tenant's cached prefix pages (suspended or deleted) at the loop's next turn;
        pages its running requests hold stay until they finish. An engine whose cache lives
        elsewhere ignores this."""
        return None

    @abstractmethod
    def _submit(self, request: GenerateRequest, sink: Sink) -> None:
        """Queue ``request`` for the loop, its outputs to go to ``sink``; raises
        EngineDeadError when the loop cannot take it."""

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's outputs; raises its InvalidRequestError, or EngineDeadError.

        Stopping the iteration early (or cancelling the consumer) aborts the request.
        """
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def sink(item: RequestOutput | BaseException) -> None:
            # RuntimeError: the consumer's loop is closed, nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(outputs.put_nowait, item)

        self._submit(request, sink)
        done = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
                if done:
                    return
        finally:
            if not done:
                self.abort(request.request_id)

    async def publish_prefix(self, prefix: str | list[int]) -> PublishedPrefix:
        """Compute a prefix once and keep its full pages as a public, pinned prefix.

        Text is tokenized as is (special tokens such as a chat template's markers included), so
        publish exactly the text that prompts will start with.
        """
        if isinstance(prefix, str):
            token_ids = await asyncio.to_thread(self.tokenizer.encode, prefix)
        else:
            token_ids = list(prefix)
        request = GenerateRequest(
            request_id=f"publish-{uuid.uuid4().hex}",
            prompt_token_ids=token_ids,
            params=SamplingParams(max_tokens=1, temperature=0.0),
            tenant_id=PUBLIC_NAMESPACE,
            publish=True,
        )
        published = 0
        async for output in self.generate(request):
            if output.error is not None:
                raise EngineError(output.error)
            published = output.num_published_tokens
        return PublishedPrefix(num_tokens=len(token_ids), num_cached_tokens=published)

    async def unpublish_prefix(self, token_ids: list[int]) -> int:
        """Release the public prefix of ``token_ids`` (the tokens a publish kept); returns the
        tokens released, 0 when nothing was published exactly there."""
        request = GenerateRequest(
            request_id=f"unpublish-{uuid.uuid4().hex}",
            prompt_token_ids=list(token_ids),
            params=SamplingParams(max_tokens=1, temperature=0.0),
            tenant_id=PUBLIC_NAMESPACE,
            unpublish=True,
        )
        released = 0
        async for output in self.generate(request):
            released = output.num_published_tokens
        return released


class AsyncEngine(EngineClient):
    """Owns an ``LLMEngine`` and the one thread that drives it."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._commands: queue.SimpleQueue[_Add | _Abort | _Stop | _Drop] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}  # engine thread only
        self._lock = threading.Lock()  # orders "is it dead?" against queueing a request
        self._dead: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._snapshot = engine.snapshot()
        self._snapshot_at = 0.0

    # -- event loop side ----------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine loop is already started")
        self._thread = threading.Thread(target=self._run, name="atrium-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Abort what is left, stop the loop and wait for the thread to end."""
        thread = self._thread
        if thread is None:
            return
        with self._lock:
            self._stopping = True
            self._commands.put(_Stop())
        await asyncio.to_thread(thread.join)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def num_unfinished(self) -> int:
        return len(self._sinks)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._engine.tokenizer

    def stats(self) -> EngineSnapshot:
        return self._snapshot

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def drop_tenant(self, tenant_id: str) -> None:
        self._commands.put(_Drop(tenant_id))

    def _submit(self, request: GenerateRequest, sink: Sink) -> None:
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine loop stopped: {self._dead!r}")
            if self._thread is None or self._stopping:
                raise EngineDeadError("the engine loop is not running")
            self._commands.put(_Add(request, sink))

    # -- engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self._engine
        try:
            while True:
                idle = not engine.has_unfinished
                if idle:
                    self._take_snapshot(force=True)
                if not self._handle(self._commands.get(block=idle) if idle else None):
                    break
                if not self._drain():
                    break
                self._deliver(engine.step())
                self._take_snapshot(force=False)
        except BaseException as exc:
            log.exception("engine_loop_died")
            self._die(exc)
            return
        self._shutdown_requests()

    def _drain(self) -> bool:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if not self._handle(command):
                return False

    def _handle(self, command: _Add | _Abort | _Stop | _Drop | None) -> bool:
        """Apply one command; False means stop the loop."""
        if command is None:
            return True
        if isinstance(command, _Stop):
            return False
        if isinstance(command, _Abort):
            self._engine.abort(command.request_id)
            return True
        if isinstance(command, _Drop):
            freed = self._engine.drop_tenant(command.tenant_id)
            log.info("tenant_cache_dropped", tenant_id=command.tenant_id, pages=freed)
            return True
        request_id = command.request.request_id
        if request_id in self._sinks:
            command.sink(InvalidRequestError(f"request id {request_id!r} is already running"))
            return True
        try:
            self._engine.add_request(command.request)
        except Exception as exc:  # the request's own error: it goes back to that request only
            command.sink(exc)
            return True
        self._sinks[request_id] = command.sink
        return True

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            sink = self._sinks.pop(output.request_id, None) if output.finished else None
            sink = sink or self._sinks.get(output.request_id)
            if sink is not None:
                sink(output)

    def _take_snapshot(self, force: bool) -> None:
        now = time.monotonic()
        if force or now - self._snapshot_at >= SNAPSHOT_INTERVAL_S:
            self._snapshot = self._engine.snapshot()
            self._snapshot_at = now

    def _shutdown_requests(self) -> None:
        for request_id in list(self._sinks):
            self._engine.abort(request_id)
        self._deliver(self._engine.step())
        self._take_snapshot(force=True)
        with self._lock:
            self._dead = EngineDeadError("the engine was shut down")
        self._fail_queued(self._dead)
        log.info("engine_stopped")

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            self._dead = exc
        for request_id, sink in list(self._sinks.items()):
            sink(RequestOutput(request_id, finished=True, finish_reason="error", error=repr(exc)))
        self._sinks.clear()
        self._fail_queued(exc)

    def _fail_queued(self, exc: BaseException) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                command.sink(EngineDeadError(f"the engine loop stopped: {exc!r}"))
