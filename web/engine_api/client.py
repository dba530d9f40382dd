"""`EngineClient` over HTTP: a gateway's engine is a router or an engine server at a URL.

Each request is one streamed ``POST /v1/completions`` with the engine token: the prompt as text
(what a router matches prefixes on) and as the gateway's token ids, the exact sampling settings
and the tenant fields (``wire``), asking for usage in every chunk, so that a stream cut off
mid-way still says how many tokens were delivered. Timeouts are bounded: an engine that accepts
no connection within the connect timeout, or goes silent past the read timeout, ends the request
(``EngineDeadError`` before its first output, an ``error`` output after it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
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


def request_body(request: GenerateRequest, model: str, prompt_text: str) -> dict[str, Any]:
    """The engine request for ``request``: OpenAI's fields, then the tenant extension."""
    params = request.params
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt_text,
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


class StreamReader:
    """Turns one engine SSE stream into ``RequestOutput`` increments with cumulative counts."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.output_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.received = False  # whether any output reached the caller

    def output(
        self, text: str = "", finished: bool = False, logprobs: list[TokenLogprob] | None = None
    ) -> RequestOutput:
        self.received = True
        return RequestOutput(
            self.request_id,
            text=text,
            logprobs=logprobs,
            finished=finished,
            finish_reason=(self.finish_reason or "error") if finished else None,
            num_prompt_tokens=self.prompt_tokens,
            num_cached_tokens=self.cached_tokens,
            num_output_tokens=self.output_tokens,
            error=self.error if finished else None,
        )

    def read(self, data: str) -> RequestOutput | None:
        """One ``data:`` payload; an output when it carries text, None otherwise."""
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            return None
        error = chunk.get("error")
        if error is not None:  # the engine's, or the router's when it lost the engine
            log.warning("engine_stream_error", error=str(error)[:200])
            self.finish_reason, self.error = "error", LOST
            return None
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            self.output_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            self.cached_tokens = int(details.get("cached_tokens") or 0)
        text = ""
        for choice in chunk.get("choices") or ():
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
        logprobs = token_logprobs(chunk.get("atrium_logprobs"))
        return self.output(text, logprobs=logprobs) if text or logprobs else None


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
            task.cancel()  # closing the stream makes the engine abort the request

    def _submit(self, request: GenerateRequest, sink: Sink) -> None:
        if self._closed:
            raise EngineDeadError("the gateway is shutting down")
        if request.request_id in self._tasks:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running")
        task = asyncio.get_running_loop().create_task(self._run(request, sink))
        self._tasks[request.request_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(request.request_id, None))

    async def _run(self, request: GenerateRequest, sink: Sink) -> None:
        reader = StreamReader(request.request_id)
        try:
            await self._stream(request, reader, sink)
        except asyncio.CancelledError:
            raise
        except (httpx.TransportError, ValueError) as exc:  # cut off, timed out, or garbled
            log.warning("engine_stream_failed", error=type(exc).__name__, url=self.url)
            if not reader.received:
                sink(EngineDeadError(UNAVAILABLE))
                return
            reader.finish_reason, reader.error = "error", LOST
            sink(reader.output(finished=True))
        except EngineError as exc:
            sink(exc)
        except TypeError as exc:  # a setting with no JSON form (sampling_to_wire)
            sink(InvalidRequestError(f"This request cannot be sent to a remote engine: {exc}"))

    async def _stream(self, request: GenerateRequest, reader: StreamReader, sink: Sink) -> None:
        text = await asyncio.to_thread(
            self._tokenizer.decode, request.prompt_token_ids, skip_special_tokens=False
        )
        body = request_body(request, self.model, text)
        url = f"{self.url}/v1/completions"
        headers = self.request_headers(request)
        async with self.http.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                raise refusal(response.status_code, await response.aread())
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                out = reader.read(data)
                if out is not None:
                    sink(out)
        if reader.finish_reason is None:  # the stream ended without saying how: it was cut off
            if not reader.received:
                raise EngineDeadError(UNAVAILABLE)
            reader.error = LOST
        sink(reader.output(finished=True))
