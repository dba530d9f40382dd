"""`EngineClient` over HTTP: a gateway's engine is a router or an engine server at a URL.

Each request is one streamed ``POST /v1/completions`` with the engine token: the prompt as text
(what a router matches prefixes on) and as the gateway's token ids, the exact sampling settings
and the tenant fields (``wire``), asking for usage in every chunk, so that a stream cut off
mid-way still says how many tokens were delivered. A prompt's ``n`` choices are one request with
``n`` (``generate_choices``): the router places it whole, the engine computes the prompt once, and
its stream is split back into the choices by index, each with its own counts (decision 55).
Timeouts are bounded: an engine that accepts no connection within the connect timeout, or goes
silent past the read timeout, ends the request (``EngineDeadError`` before its first output, an
``error`` output after it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import structlog

from engine.async_engine import EngineClient
from engine.errors import EngineDeadError, EngineError, InvalidRequestError, PromptTooLongError
from engine.outputs import GenerateRequest, RequestOutput, TokenLogprob
from engine.sinks import Sink
from engine.stats import EngineSnapshot
from engine.tokenizer import Tokenizer
from web.engine_api.wire import sampling_to_wire

log = structlog.get_logger("atrium.engine_client")
LOST = "The engine stopped answering mid-stream."
UNAVAILABLE = "No engine is available right now; retry shortly."
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


def request_body(
    request: GenerateRequest, model: str, prompt_text: str, n: int = 1
) -> dict[str, Any]:
    """The engine request for ``request`` (with ``n``, for it and its next ``n - 1`` siblings):
    OpenAI's fields, then the tenant extension."""
    params = request.params
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt_text,
        "n": n,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "seed": params.seed,
        "stop": list(params.stop) or None,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "cache_salt": request.tenant_id,
        "atrium_tenant_weight": request.tenant_weight,
        "atrium_allow_public_prefix": request.allow_public_prefix,
        "atrium_prompt_token_ids": request.prompt_token_ids,
        "atrium_sampling": sampling_to_wire(params),
    }
    if request.kv_cache_share is not None:
        body["atrium_kv_cache_share"] = request.kv_cache_share
    if request.background:
        body["atrium_background"] = True
    if request.tenant_requests:
        body["atrium_tenant_requests"] = request.tenant_requests
    if request.lora_name is not None:
        body["atrium_lora_id"] = request.lora_name
        body["atrium_lora_path"] = request.lora_path
    return body


def refusal(status: int, raw: bytes) -> EngineError:
    """The engine error for a non-200 answer: a 400 is the request's fault, the rest is ours."""
    detail: dict[str, Any] = {}
    with contextlib.suppress(ValueError, AttributeError):
        found = json.loads(raw).get("error")
        detail = found if isinstance(found, dict) else {}
    message = str(detail.get("message") or f"The engine answered {status}.")
    if status in (400, 413, 422):
        param = detail.get("param")
        if detail.get("code") == PromptTooLongError.code:
            return PromptTooLongError(message, param)
        return InvalidRequestError(message, param if isinstance(param, str) else None)
    if status == 401:
        log.error("engine_token_refused", status=status)
    else:
        log.warning("engine_refused", status=status, message=message)
    return EngineDeadError(UNAVAILABLE)


@dataclass(slots=True)
class ChoiceCounts:
    """What one choice of an engine stream has delivered so far (counts cumulative)."""

    request_id: str
    cached_tokens: int = 0
    output_tokens: int = 0
    finished: bool = False


class StreamReader:
    """Turns one engine SSE stream, of one choice or of a prompt's ``n``, into each choice's
    ``RequestOutput`` increments with cumulative counts. The stream's choice ``j`` is
    ``request_ids[j]``; its chunks name their choice's counts (``atrium_choice_usage``), since
    the one ``usage`` of ``n`` choices counts the prompt once and sums their tokens."""

    def __init__(self, request_ids: Sequence[str]) -> None:
        self.choices = [ChoiceCounts(request_id) for request_id in request_ids]
        self.prompt_tokens = 0
        self.received = False  # whether any output reached the caller

    @property
    def unfinished(self) -> list[ChoiceCounts]:
        return [choice for choice in self.choices if not choice.finished]

    def output(
        self,
        choice: ChoiceCounts,
        text: str = "",
        logprobs: list[TokenLogprob] | None = None,
        finish_reason: str | None = None,
        error: str | None = None,
    ) -> RequestOutput:
        self.received = True
        choice.finished = finish_reason is not None
        return RequestOutput(
            choice.request_id,
            text=text,
            logprobs=logprobs,
            finished=choice.finished,
            finish_reason=finish_reason,
            num_prompt_tokens=self.prompt_tokens,
            num_cached_tokens=choice.cached_tokens,
            num_output_tokens=choice.output_tokens,
            error=error,
        )

    def end(self, finish_reason: str, error: str | None = None) -> list[RequestOutput]:
        """The last output of every choice still open, as the stream ends without theirs."""
        return [self.output(c, finish_reason=finish_reason, error=error) for c in self.unfinished]

    def read(self, data: str) -> list[RequestOutput]:
        """One ``data:`` payload; the outputs it carries (text, logprobs, a choice's end)."""
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            return []
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = _count(usage, "prompt_tokens")
            if len(self.choices) == 1:  # one choice: the stream's counts are its own
                details = usage.get("prompt_tokens_details") or {}
                self.choices[0].cached_tokens = _count(details, "cached_tokens")
                self.choices[0].output_tokens = _count(usage, "completion_tokens")
        named = self._counted(chunk.get("atrium_choice_usage"))
        error = chunk.get("error")
        if error is not None:  # the engine's for one choice, or the router's for them all
            log.warning("engine_stream_error", error=str(error)[:200])
            ended = self.unfinished if named is None else [named]
            return [self.output(c, finish_reason="error", error=LOST) for c in ended
                    if not c.finished]  # fmt: skip
        items = chunk.get("choices") or []
        outputs = []
        for item in items if isinstance(items, list) else [items]:
            if not isinstance(item, dict):
                raise ValueError(f"bad choice in an engine chunk: {item!r:.80}")
            choice = self._choice(item.get("index", 0))
            if len(self.choices) > 1 and choice is not named:
                raise ValueError("a chunk of several choices without its choice's counts")
            delta = item.get("delta")
            text = item.get("text") or (delta.get("content") if isinstance(delta, dict) else "")
            if not isinstance(text, str | None):
                raise ValueError(f"bad text in an engine chunk: {text!r:.80}")
            text = text or ""
            logprobs = token_logprobs(chunk.get("atrium_logprobs")) if len(items) == 1 else None
            reason = item.get("finish_reason")
            if choice.finished or not (text or logprobs or reason):
                continue
            outputs.append(self.output(choice, text, logprobs, str(reason) if reason else None))
        return outputs

    def _choice(self, index: object) -> ChoiceCounts:
        if type(index) is not int or not 0 <= index < len(self.choices):
            raise ValueError(f"no choice {index!r} in a stream of {len(self.choices)}")
        return self.choices[index]

    def _counted(self, raw: object) -> ChoiceCounts | None:
        """The choice whose counts ``raw`` (``atrium_choice_usage``) names, updated; None
        without them."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ValueError("bad atrium_choice_usage")
        choice = self._choice(raw.get("index"))
        choice.output_tokens = _count(raw, "completion_tokens")
        choice.cached_tokens = _count(raw, "cached_tokens")
        return choice


def _count(counts: object, name: str) -> int:
    """A token count of the stream (0 when absent); a ValueError, as for garbled JSON, when it
    is not one."""
    value = counts.get(name) if isinstance(counts, dict) else None
    if value is None:
        return 0
    if type(value) is not int or value < 0:
        raise ValueError(f"bad token count {name}: {value!r}")
    return value


def token_logprobs(raw: object) -> list[TokenLogprob] | None:
    """The engine's ``atrium_logprobs`` (``[[id, logprob, [[id, logprob], ...]], ...]``)."""
    if not isinstance(raw, list) or not raw:
        return None
    try:
        return [
            TokenLogprob(int(token), float(logprob), tuple((int(i), float(lp)) for i, lp in top))
            for token, logprob, top in raw
        ]
    except TypeError as exc:  # a garbled stream, as a JSON error would be
        raise ValueError(f"bad atrium_logprobs: {exc}") from exc


class HttpEngineClient(EngineClient):
    """The engine behind ``url`` (a router or an engine server), spoken to over HTTP."""

    def __init__(
        self,
        url: str,
        token: str,
        tokenizer: Tokenizer,
        model: str,
        *,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 120.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self._token = token
        self._tokenizer = tokenizer
        timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s, pool=connect_timeout_s)
        self._timeout = timeout
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._snapshot = EngineSnapshot()
        self._closed = False
        self.fleet: Any = None  # the engines behind the URL (web.engine_api.fleet.Fleet)

    @property
    def token(self) -> str:
        return self._token

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._token}"}

    def request_headers(self, request: GenerateRequest) -> dict[str, str]:
        """The token, the request id for the logs, and the tenant as the routing key that
        smg's consistent_hashing and manual policies pin to one engine (others ignore it)."""
        return {
            **self.headers,
            "x-request-id": request.request_id,
            ROUTING_KEY_HEADER: request.tenant_id,
        }

    @property
    def http(self) -> httpx.AsyncClient:
        if self._client is None:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            self._client = httpx.AsyncClient(
                timeout=self._timeout, limits=limits, transport=self._transport
            )
        return self._client

    def start(self) -> None:
        self._closed = False

    async def shutdown(self) -> None:
        self._closed = True
        for task in list(self._tasks.values()):
            task.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks.values()), timeout=5.0)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    @property
    def is_running(self) -> bool:
        """Open, and (where the engines behind the URL are polled) one answered the last poll."""
        return not self._closed and bool(getattr(self.fleet, "answering", True))

    @property
    def num_unfinished(self) -> int:
        return len(self._tasks)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def stats(self) -> EngineSnapshot:
        return self._snapshot

    def set_snapshot(self, snapshot: EngineSnapshot) -> None:
        """The engines' state as last polled (``web.engine_api.fleet``)."""
        self._snapshot = snapshot

    def abort(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            # Closing the stream makes the engine abort the request: every choice it carries.
            task.cancel()

    async def generate_choices(
        self, requests: Sequence[GenerateRequest]
    ) -> AsyncGenerator[RequestOutput, None]:
        """A prompt's choices as one engine request with ``n``: ``requests[0]`` and its
        siblings (``prefill_after`` it), which the engine makes again from it and ``n``. Their
        outputs come interleaved, each under its own request id with its own counts; stopping
        early (or cancelling the consumer) aborts those not finished. An engine that refuses
        ``n`` before any output gets the choices one request each."""
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._submit_choices(list(requests), outputs.put_nowait)
        unfinished = {request.request_id for request in requests}
        grouped = True
        try:
            while unfinished:
                item = await outputs.get()
                if grouped and isinstance(item, InvalidRequestError) and item.param == "n":
                    # An engine of the previous release takes no ``n`` (during a rolling
                    # upgrade): each choice goes alone, as that release's gateways sent them.
                    log.info("engine_takes_no_n", url=self.url, n=len(requests))
                    grouped = False
                    for request in requests:
                        self._tasks.pop(request.request_id, None)
                        self._submit_choices([request], outputs.put_nowait)
                    continue
                grouped = grouped and not isinstance(item, RequestOutput)
                if isinstance(item, BaseException):
                    unfinished.clear()
                    raise item
                if item.finished:
                    unfinished.discard(item.request_id)
                yield item
        finally:
            for request_id in unfinished:
                self.abort(request_id)

    def _submit(self, request: GenerateRequest, sink: Sink) -> None:
        self._submit_choices([request], sink)

    def _submit_choices(self, requests: list[GenerateRequest], sink: Sink) -> None:
        if self._closed:
            raise EngineDeadError("the gateway is shutting down")
        first = requests[0]
        for sibling in requests[1:]:
            if (sibling.prefill_after, sibling.prompt_token_ids) != (
                first.request_id,
                first.prompt_token_ids,
            ):
                raise ValueError(f"{sibling.request_id!r} is no choice of {first.request_id!r}")
        request_ids = [request.request_id for request in requests]
        for request_id in request_ids:
            if request_id in self._tasks:
                raise InvalidRequestError(f"request id {request_id!r} is already running")
        task = asyncio.get_running_loop().create_task(self._run(requests, sink))
        for request_id in request_ids:
            self._tasks[request_id] = task

        def forget(_: object) -> None:
            for request_id in request_ids:
                if self._tasks.get(request_id) is task:  # not a later request of the same id
                    del self._tasks[request_id]

        task.add_done_callback(forget)

    async def _run(self, requests: list[GenerateRequest], to_caller: Sink) -> None:
        reader = StreamReader([request.request_id for request in requests])

        def sink(item: RequestOutput | BaseException) -> None:
            if isinstance(item, RequestOutput) and item.finished:
                self._tasks.pop(item.request_id, None)  # an abort of it now ends no sibling
            to_caller(item)

        try:
            await self._stream(requests, reader, sink)
        except asyncio.CancelledError:  # aborted: its choices end as an engine's aborts end
            for out in reader.end("abort"):
                sink(out)
            raise
        except (httpx.TransportError, ValueError) as exc:  # cut off, timed out, or garbled
            log.warning("engine_stream_failed", error=type(exc).__name__, url=self.url)
            if not reader.received:
                sink(EngineDeadError(UNAVAILABLE))
                return
            for out in reader.end("error", LOST):
                sink(out)
        except EngineError as exc:
            sink(exc)
        except TypeError as exc:  # a setting with no JSON form (sampling_to_wire)
            sink(InvalidRequestError(f"This request cannot be sent to a remote engine: {exc}"))

    async def _stream(
        self, requests: list[GenerateRequest], reader: StreamReader, sink: Sink
    ) -> None:
        first = requests[0]
        text = await asyncio.to_thread(
            self._tokenizer.decode, first.prompt_token_ids, skip_special_tokens=False
        )
        body = request_body(first, self.model, text, len(requests))
        url = f"{self.url}/v1/completions"
        headers = self.request_headers(first)
        async with self.http.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                raise refusal(response.status_code, await response.aread())
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                for out in reader.read(data):
                    sink(out)
        if reader.unfinished:  # the stream ended without saying how: it was cut off
            if not reader.received:
                raise EngineDeadError(UNAVAILABLE)
            for out in reader.end("error", LOST):
                sink(out)
