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
import dataclasses
import queue
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator

import structlog

from engine.commands import Abort, Add, Command, Drop, Stop
from engine.engine_loop import EngineLoop
from engine.errors import EngineDeadError, EngineError
from engine.llm_engine import LLMEngine
from engine.outputs import GenerateRequest, PublishedPrefix, RequestOutput
from engine.sampling_params import SamplingParams
from engine.sinks import Sink, Sinks
from engine.stats import EngineSnapshot
from engine.tokenizer import Tokenizer
from radix_cache.prefix_cache import PUBLIC_NAMESPACE

log = structlog.get_logger(__name__)


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

        if request.arrived_at is None:  # its first-token deadline counts from now
            request = dataclasses.replace(request, arrived_at=time.monotonic())
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


class _QueueInbox:
    """The loop's commands from a thread-safe queue of this process."""

    def __init__(self, commands: queue.SimpleQueue[Command]) -> None:
        self.commands = commands

    def get(self, timeout: float | None) -> Command | None:
        try:
            if timeout is None:
                return self.commands.get()
            if timeout <= 0:
                return self.commands.get_nowait()
            return self.commands.get(timeout=timeout)
        except queue.Empty:
            return None


class AsyncEngine(EngineClient):
    """Owns an ``LLMEngine`` and the one thread that runs its loop (``engine/engine_loop.py``)."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._sinks = Sinks()
        self._lock = threading.Lock()  # orders "is it dead?" against queueing a request
        self._dead: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._snapshot = engine.snapshot()

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
            self._commands.put(Stop())
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
        self._commands.put(Abort(request_id))

    def drop_tenant(self, tenant_id: str) -> None:
        self._commands.put(Drop(tenant_id))

    def _submit(self, request: GenerateRequest, sink: Sink) -> None:
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine loop stopped: {self._dead!r}")
            if self._thread is None or self._stopping:
                raise EngineDeadError("the engine loop is not running")
            self._sinks.add(request.request_id, sink)
            self._commands.put(Add(request))

    # -- engine thread: the loop's outbox -----------------------------------------------------

    def reject(self, request_id: str, exc: Exception) -> None:
        self._sinks.fail(request_id, exc)

    def report(self, outputs: list[RequestOutput], snapshot: EngineSnapshot | None) -> None:
        self._sinks.deliver(outputs)
        if snapshot is not None:
            self._snapshot = snapshot

    def _run(self) -> None:
        try:
            EngineLoop(self._engine, _QueueInbox(self._commands), self).run()
        except BaseException as exc:
            log.exception("engine_loop_died")
            self._die(exc)
            return
        with self._lock:
            self._dead = EngineDeadError("the engine was shut down")
        self._fail_queued(self._dead)
        log.info("engine_stopped")

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            self._dead = exc
        self._fail_queued(exc)
        self._sinks.end_all(repr(exc))

    def _fail_queued(self, exc: BaseException) -> None:
        """Requests still queued when the loop ended never reached it: they fail to start."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, Add):
                error = EngineDeadError(f"the engine loop stopped: {exc!r}")
                self._sinks.fail(command.request.request_id, error)
