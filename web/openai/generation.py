"""Generation behind the OpenAI routes: tokenize off the loop, admit, run on the engine, meter.

Every admitted request ends in exactly one usage event, written by a task of its own so that a
client disconnect (which cancels the streaming task) cannot lose it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import inspect
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import structlog
from litestar.datastructures import State
from opentelemetry import trace
from opentelemetry.context import Context

from engine.errors import EngineError, InvalidRequestError, PromptTooLongError
from engine.outputs import GenerateRequest, RequestOutput
from engine.sampling_params import SamplingParams
from tenants.lora_adapters import LoraAdapterInfo, LoraAdapterService
from web.ops.errors import CLIENT_CLOSED, ApiError, to_api_error, unavailable
from web.ops.metrics import GatewayMetrics
from web.ops.refusals import RefusalLog
from web.ops.request_log import RequestTrail
from web.ops.tracing import RequestSpans
from web.tenancy.fair_gate import FairGate
from web.tenancy.principal import Principal, Tenancy, Ticket, UsageRecord

if TYPE_CHECKING:
    from web.openai.structured_output import GrammarLimits

log = structlog.get_logger("atrium.web")
# The served model the request being handled was routed to: set by ``check_model`` in the
# request's own task, so the tokenizer, context length and engine that follow are that model's.
_ROUTED: contextvars.ContextVar[ModelRuntime | None] = contextvars.ContextVar(
    "atrium_routed_model", default=None
)


def model_not_found(model: str) -> ApiError:
    """The 404 for a model this server does not serve, or one the caller may not call (as OpenAI
    answers for a model outside a project's allow-list: its existence is not revealed)."""
    return ApiError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
    )


class TokenizerLike(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class GenerationEngine(Protocol):
    """What serving needs of an engine: the engine's own clients and test fakes satisfy it."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> Any: ...


@runtime_checkable
class ChoicesEngine(Protocol):
    """An engine that takes a prompt's choices as one request: a remote one sends them as one
    HTTP request with ``n``, which a router places whole on one engine (its ``abort`` of any
    of them ends them all)."""

    def generate_choices(
        self, requests: Sequence[GenerateRequest]
    ) -> AsyncIterator[RequestOutput]: ...


@dataclass(slots=True)
class ModelRuntime:
    """The served model: its engine, tokenizer, context length and the names it answers to."""

    name: str
    engine: GenerationEngine
    tokenizer: TokenizerLike
    max_model_len: int
    aliases: tuple[str, ...] = ()
    stats: Callable[[], dict[str, object]] | None = None
    # Tokens the engine's KV cache holds (None: unknown); a longer prompt is refused at once.
    kv_capacity_tokens: int | None = None
    # Sampling settings this engine cannot honour (one reached over HTTP may not return
    # logprobs): a request that sets one is refused with 400 unsupported_parameter at admission.
    unsupported_params: frozenset[str] = frozenset()

    def serves(self, model: str) -> bool:
        return model == self.name or model in self.aliases


@dataclass(slots=True)
class Choice:
    """One sequence of a job: a prompt's ``n``-th answer, run as its own engine request."""

    index: int  # the choice's index in the answer
    request_id: str  # the engine's request id
    prompt_token_ids: list[int]
    params: SamplingParams
    prefill_after: str | None = None  # the sibling whose computed prompt this one reuses
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None


@dataclass(slots=True)
class Job:
    """One admitted generation (one or more choices) and what it has produced so far.

    Usage counts each distinct prompt once (its first choice computes it, its siblings reuse
    its pages) and every choice's completion tokens.
    """

    request_id: str
    endpoint: str
    prompt_token_ids: list[int]
    params: SamplingParams
    ticket: Ticket
    spans: RequestSpans
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.monotonic)
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    first_token_at: float | None = None
    last_token_at: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    usage_task: asyncio.Task[None] | None = None
    choices: list[Choice] = field(default_factory=list)
    adapter: LoraAdapterInfo | None = None  # the LoRA adapter named in ``model``, if any
    runtime: ModelRuntime | None = None  # the model (engine) serving it; None: the first
    # When the request arrived (before authentication and admission): latencies count from it.
    arrived: float = field(default_factory=time.monotonic)
    trail: RequestTrail | None = None  # its one log line, written when it ends
    http_status: int = 200  # what its client got: an error's status when refused at once
    _by_id: dict[str, Choice] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        if not self.choices:
            self.choices = [Choice(0, self.request_id, self.prompt_token_ids, self.params)]
        self._by_id = {choice.request_id: choice for choice in self.choices}

    @property
    def tenant_id(self) -> str:
        return self.ticket.principal.tenant_id

    def choice_of(self, output: RequestOutput) -> Choice:
        return self._by_id[output.request_id]

    @property
    def done(self) -> bool:
        return all(choice.finish_reason is not None for choice in self.choices)


class GenerationService:
    """Turns validated requests into engine requests and accounts for every one of them."""

    def __init__(
        self,
        runtime: ModelRuntime | Sequence[ModelRuntime],
        tenancy: Tenancy,
        metrics: GatewayMetrics,
        tracer: trace.Tracer,
        *,
        default_max_tokens_cap: int = 1024,
        retry_after_s: float = 1.0,
        admission_concurrency: int = 1,
        trace_steps: bool = False,
        max_stream_s: float | None = None,
    ) -> None:
        # The served models, each with its own engine; the first is the default ``runtime``.
        self.runtimes: list[ModelRuntime] = (
            [runtime] if isinstance(runtime, ModelRuntime) else list(runtime)
        )
        if not self.runtimes:
            raise ValueError("a generation service needs at least one model")
        # Spans are exported: ask the engine for a span per prefill chunk and decode step.
        self.trace_steps = trace_steps
        self.tenancy = tenancy
        self.metrics = metrics
        self.tracer = tracer
        self.default_max_tokens_cap = default_max_tokens_cap
        self.retry_after_s = retry_after_s
        # The longest a response may run (None: no limit); past it the answer ends as "length".
        self.max_stream_s = max_stream_s
        self.draining = False
        self.num_arriving = 0  # requests between their arrival and their hand-off to the engine
        # Each engine tenant's requests from admission (waiting at the gate included) to their
        # end: the engine ranks a tenant's burst by it before the burst has reached the engine.
        self.tenant_requests: collections.Counter[str] = collections.Counter()
        # Admissions in flight at once; past that, tenants take turns (web/tenancy/fair_gate.py).
        self.admission_gate = FairGate(admission_concurrency)
        self.active: dict[str, Job] = {}
        # Shortest answers under grammars (web/openai/structured_output.py), built on first use.
        self.grammar_limits: dict[str, GrammarLimits] = {}  # by served model name
        # The LoRA adapters tenants may name in ``model`` (tenants/lora_adapters.py); None where
        # no database backs the server (then only the base model is served).
        self.adapters: LoraAdapterService | None = None
        # Admissions refused, by tenant (the console's; /metrics counts them by reason only).
        self.refusals = RefusalLog()
        self._tasks: set[asyncio.Task[Any]] = set()

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        """Count a request from its arrival until it is admitted or refused: the engine learns,
        with each request, how many others are right behind it."""
        self.num_arriving += 1
        try:
            yield
        finally:
            self.num_arriving -= 1

    @property
    def runtime(self) -> ModelRuntime:
        """The model the current request was routed to (``resolve_model``), else the first."""
        current = _ROUTED.get()
        if current is not None and any(current is served for served in self.runtimes):
            return current
        return self.runtimes[0]

    @runtime.setter
    def runtime(self, runtime: ModelRuntime) -> None:
        self.runtimes[0] = runtime

    def runtime_for(self, model: str) -> ModelRuntime | None:
        """The served model answering to ``model`` (its name or an alias), if any."""
        return next((runtime for runtime in self.runtimes if runtime.serves(model)), None)

    def visible_runtimes(self, principal: Principal) -> list[ModelRuntime]:
        """The served models ``principal`` may call (its key's and its tenant's lists)."""
        return [r for r in self.runtimes if principal.allows_model(r.name, *r.aliases)]

    def check_model(self, model: str, principal: Principal | None = None) -> None:
        """Route the current request to the model ``model`` names; 404 for a model this server
        does not serve, or one the key or its tenant may not call (as OpenAI answers for a model
        outside a project's allow-list: its existence is not revealed)."""
        runtime = self.runtime_for(model)
        allowed = runtime is not None and (
            principal is None or principal.allows_model(model, runtime.name, *runtime.aliases)
        )
        if runtime is None or not allowed:
            raise model_not_found(model)
        _ROUTED.set(runtime)

    def base_runtime(self, adapter: LoraAdapterInfo) -> ModelRuntime | None:
        """The served model ``adapter`` rides on: its base model, or the first served model
        when it names none; None when this server does not serve its base model."""
        if adapter.base_model is None:
            return self.runtimes[0]
        return self.runtime_for(adapter.base_model)

    async def resolve_model(self, model: str, principal: Principal) -> LoraAdapterInfo | None:
        """Route the request to what ``model`` names: a served model (None) or a LoRA adapter
        of this tenant (on its base model); 404 for anything else, another tenant's adapter
        and one whose base model this server does not serve included (its existence is not
        revealed). The one place a ``model`` field is read."""
        if self.runtime_for(model) is not None or self.adapters is None:
            self.check_model(model, principal)
            return None
        adapter = await self.adapters.usable(principal.tenant_id, model)
        base = None if adapter is None else self.base_runtime(adapter)
        if base is None or not principal.allows_model(model):
            raise model_not_found(model)
        _ROUTED.set(base)
        return adapter

    def check_open(self) -> None:
        if self.draining:
            raise unavailable("The server is shutting down.", self.retry_after_s, code="draining")

    async def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return await asyncio.to_thread(self.runtime.tokenizer.apply_chat_template, messages)

    async def tokenize_text(self, text: str) -> list[int]:
        return await asyncio.to_thread(self.runtime.tokenizer.encode, text)

    def resolve_max_tokens(
        self, num_prompt_tokens: int, requested: int | None, prompt_param: str
    ) -> int:
        """The requested max_tokens if it fits the context, else the remaining context, capped."""
        limit = self.runtime.max_model_len
        remaining = limit - num_prompt_tokens
        capacity = self.runtime.kv_capacity_tokens
        if capacity is not None and num_prompt_tokens > capacity:
            # The engine would refuse it after admission: refuse it before anything is reserved.
            raise PromptTooLongError(
                f"The prompt has {num_prompt_tokens} tokens; the KV cache holds {capacity}.",
                prompt_param,
            )
        if requested is not None and requested <= 0:
            return requested  # SamplingParams.validate names it
        if remaining <= 0:
            raise PromptTooLongError(
                f"This model's maximum context length is {limit} tokens; "
                f"the prompt has {num_prompt_tokens}.",
                prompt_param,
            )
        if requested is None:
            return min(remaining, self.default_max_tokens_cap)
        if requested > remaining:
            raise PromptTooLongError(
                f"This model's maximum context length is {limit} tokens; the prompt has "
                f"{num_prompt_tokens} and max_tokens asks for {requested} more.",
                "max_tokens",
            )
        return requested

    async def admit(
        self,
        principal: Principal,
        endpoint: str,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> Job:
        return await self.admit_choices(
            principal, endpoint, request_id, [(prompt_token_ids, params)]
        )

    def _check_supported(self, params: SamplingParams) -> None:
        for name in sorted(self.runtime.unsupported_params):
            if getattr(params, name) != SamplingParams.__dataclass_fields__[name].default:
                raise ApiError(
                    400,
                    f"`{name}` is not supported by this deployment's engine.",
                    code="unsupported_parameter",
                    param=name,
                )

    async def admit_choices(
        self,
        principal: Principal,
        endpoint: str,
        request_id: str,
        prompts: list[tuple[list[int], SamplingParams]],
        n: int = 1,
        trace_parent: Context | None = None,
        adapter: LoraAdapterInfo | None = None,
        trail: RequestTrail | None = None,
    ) -> Job:
        """Admit ``n`` choices of each prompt as one request: quotas see every prompt once and
        ``n`` times its max_tokens; a prompt's later choices wait for its first to compute it.
        ``trail`` is the request's log line from its arrival (a new one when not given)."""
        if trail is None:
            trail = RequestTrail(request_id, endpoint)
        self.check_open()
        runtime = self.runtime
        for _, params in prompts:
            params.validate()
            self._check_supported(params)
        choices = _choices(request_id, prompts, n)
        num_prompt_tokens = sum(len(ids) for ids, _ in prompts)
        max_tokens = sum(choice.params.max_tokens for choice in choices)
        # A tenant's batch lines take turns apart from its interactive requests, at their weight.
        model = runtime.name if adapter is None else adapter.name
        trail.note(
            tenant=principal.tenant_id,
            key_id=principal.key_id,
            model=model,
            batch_id=principal.batch_id,
        )
        self.tenant_requests[principal.engine_tenant_id] += 1
        queued = time.monotonic()  # waiting from here: the fair gate, then quotas and budget
        try:
            async with self.admission_gate.hold(principal.engine_tenant_id, principal.weight):
                admission = asyncio.ensure_future(
                    self.tenancy.admit(
                        principal, request_id, num_prompt_tokens, max_tokens, model=model
                    )
                )
                try:
                    ticket = await asyncio.shield(admission)
                except asyncio.CancelledError:
                    # Cancelled (a client gone, a batch line handed back) while the reservation
                    # may already be committed: settle it here, never leave it to a lease
                    # reclaim.
                    self._spawn(self._abandon(admission, principal, request_id, model))
                    raise
                except Exception as error:  # a quota, a budget, the tenant's status: refused
                    batch = principal.batch_id is not None
                    self.refusals.record(principal.tenant_id, principal.key_id, error, batch=batch)
                    raise
        except BaseException:
            self._leave(principal.engine_tenant_id)
            raise
        self.metrics.observe_queue(principal.tenant_id, runtime.name, time.monotonic() - queued)
        spans = RequestSpans(
            self.tracer,
            f"generate {endpoint}",
            {"atrium.request_id": request_id, "atrium.tenant_id": principal.tenant_id},
            trace_parent,
        )
        first_ids, first_params = prompts[0]
        job = Job(
            request_id,
            endpoint,
            first_ids,
            first_params,
            ticket,
            spans,
            choices=choices,
            adapter=adapter,
            runtime=runtime,
            arrived=trail.arrived,
            trail=trail,
        )
        job.prompt_tokens = num_prompt_tokens
        self.active[request_id] = job
        self.metrics.in_flight.inc()
        return job

    def delivered(self) -> list[tuple[Ticket, int]]:
        """Each request in flight's ticket and the output tokens it has delivered so far."""
        return [(job.ticket, job.completion_tokens) for job in self.active.values()]

    def _engine_request(self, job: Job, choice: Choice) -> GenerateRequest:
        principal = job.ticket.principal
        return GenerateRequest(
            request_id=choice.request_id,
            prompt_token_ids=choice.prompt_token_ids,
            params=choice.params,
            tenant_id=principal.engine_tenant_id,
            tenant_weight=principal.weight,
            tenant_requests=max(
                self.tenant_requests[principal.engine_tenant_id], principal.tenant_requests
            ),
            allow_public_prefix=principal.allow_public_prefix,
            kv_cache_share=principal.kv_cache_share,
            num_following=self.num_arriving + len(job.choices) - 1 - choice.index,
            prefill_after=choice.prefill_after,
            trace_steps=self.trace_steps,
            # The engine keys slots and cache namespaces on the registration's id: an adapter
            # registered again under the same name never meets the old one's KV.
            lora_name=None if job.adapter is None else job.adapter.id,
            lora_path=None if job.adapter is None else job.adapter.path,
            background=principal.background,
        )

    async def first_output(self, job: Job, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
        """The first output, awaited before any byte is sent so that early failures are HTTP
        errors; a refusal is answered only once its usage is recorded (the slot is back)."""
        try:
            async for out in outputs:
                return out
        except EngineError:
            await self.wait_recorded(job)
            raise
        await self.wait_recorded(job)
        raise ApiError(503, "The engine ended the request without output.", code="engine_error")

    async def outputs(self, job: Job) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for all of ``job``'s choices (``job.choice_of`` tells whose),
        until every choice is finished; however this ends, the job is finalized once."""
        status = "error"
        received = False
        merged = self._merged(job)
        try:
            async for out in merged:
                received = True
                self._account(job, out)
                if out.steps:
                    job.spans.steps(out.steps)
                if out.finished:
                    job.choice_of(out).finish_reason = out.finish_reason
                    job.finish_reason = job.choices[0].finish_reason
                    if job.done:
                        failed = any(c.finish_reason == "error" for c in job.choices)
                        status = "error" if failed else "ok"
                last = [out]
                if not job.done and self._past_limit(job):
                    last += self._cut(job)
                    status = "ok"
                if job.done:
                    # Closed before the last output goes out: a caller that stops at the output
                    # that finishes the job (a one-token answer) never resumes this generator,
                    # and its usage must not wait for the garbage collector, nor read as a
                    # disconnect.
                    await merged.aclose()
                    self._finalize(job, status)
                for item in last:
                    yield item
                if job.done:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            if not job.done:
                status = "disconnect"
            raise
        except EngineError as error:
            if not received:  # refused before computing anything: recorded, never billed
                status = "rejected" if isinstance(error, InvalidRequestError) else "unavailable"
                job.http_status = to_api_error(error).status_code
                job.prompt_tokens = job.cached_tokens = job.completion_tokens = 0
                raise
            # Mid-answer (a lost engine connection): the answer so far stands and is metered;
            # each unfinished choice ends as an engine death ends it, with an error output.
            status = "error"
            for choice in job.choices:
                if choice.finish_reason is None:
                    abort = self._runtime_of(job).engine.abort(choice.request_id)
                    self._spawn(self._maybe_await(abort))
                    choice.finish_reason = "error"
                    yield RequestOutput(
                        choice.request_id,
                        finished=True,
                        finish_reason="error",
                        error=str(error),
                        num_prompt_tokens=len(choice.prompt_token_ids),
                        num_output_tokens=choice.completion_tokens,
                    )
            job.finish_reason = job.choices[0].finish_reason
        finally:
            for choice in job.choices:
                if choice.finish_reason is None:
                    abort = self._runtime_of(job).engine.abort(choice.request_id)
                    self._spawn(self._maybe_await(abort))
            self._finalize(job, status)

    def _past_limit(self, job: Job) -> bool:
        limit = self.max_stream_s
        return limit is not None and time.monotonic() - job.started > limit

    def _cut(self, job: Job) -> list[RequestOutput]:
        """End every unfinished choice of a job past ``max_stream_s``: aborted in the engine,
        finished as "length" with what it delivered."""
        log.info("request_past_max_stream", request_id=job.request_id)
        cuts = []
        for choice in job.choices:
            if choice.finish_reason is None:
                abort = self._runtime_of(job).engine.abort(choice.request_id)
                self._spawn(self._maybe_await(abort))
                choice.finish_reason = "length"
                cuts.append(
                    RequestOutput(
                        choice.request_id,
                        finished=True,
                        finish_reason="length",
                        num_prompt_tokens=len(choice.prompt_token_ids),
                        num_output_tokens=choice.completion_tokens,
                    )
                )
        job.finish_reason = job.choices[0].finish_reason
        return cuts

    async def _merged(self, job: Job) -> AsyncGenerator[RequestOutput, None]:
        """The engine's streams for ``job``'s choices, interleaved as outputs arrive (submitted
        in order, so a prompt's first choice reaches the engine before the siblings that wait
        for it)."""
        streams = self._streams(job)
        if len(streams) == 1:
            async for out in streams[0]:
                yield out
            return
        queue: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue()

        async def pump(stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in stream:
                    await queue.put(out)
            except Exception as exc:  # handed to the consumer, which raises it
                await queue.put(exc)
            await queue.put(None)

        tasks = [asyncio.create_task(pump(stream)) for stream in streams]
        try:
            for _ in range(len(tasks)):
                while (item := await queue.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _streams(self, job: Job) -> list[AsyncIterator[RequestOutput]]:
        """One stream per choice; for an engine that takes a prompt's choices together, one
        per prompt (its choices computed on one engine, its prompt once)."""
        engine = self._runtime_of(job).engine
        if not isinstance(engine, ChoicesEngine):
            return [engine.generate(self._engine_request(job, c)) for c in job.choices]
        streams = []
        for group in _prompt_groups(job.choices):
            requests = [self._engine_request(job, choice) for choice in group]
            one = len(requests) == 1
            streams.append(
                engine.generate(requests[0]) if one else engine.generate_choices(requests)
            )
        return streams

    def _runtime_of(self, job: Job) -> ModelRuntime:
        return self.runtimes[0] if job.runtime is None else job.runtime

    def _account(self, job: Job, out: RequestOutput) -> None:
        now = time.monotonic()
        choice = job.choice_of(out)
        choice.cached_tokens = max(choice.cached_tokens, out.num_cached_tokens)
        # Each prompt once: its siblings' cached tokens are the pages its first choice computed.
        job.cached_tokens = sum(c.cached_tokens for c in job.choices if c.prefill_after is None)
        new_tokens = out.num_output_tokens - choice.completion_tokens
        if new_tokens > 0:
            model = self._runtime_of(job).name
            if job.first_token_at is None:
                job.first_token_at = now
                self.metrics.observe_ttft(job.tenant_id, model, now - job.arrived)
                job.spans.first_token()
            elif job.last_token_at is not None:
                self.metrics.observe_itl(
                    job.tenant_id, model, (now - job.last_token_at) / new_tokens
                )
            job.last_token_at = now
            choice.completion_tokens = out.num_output_tokens
            job.completion_tokens = sum(c.completion_tokens for c in job.choices)

    def _finalize(self, job: Job, status: str) -> None:
        """Close the books on ``job`` without awaiting (this may run inside a cancellation)."""
        if self.active.pop(job.request_id, None) is None:
            return
        self._leave(job.ticket.principal.engine_tenant_id)
        runtime = self._runtime_of(job)
        self.metrics.in_flight.dec()
        self.metrics.count_request(job.tenant_id, job.endpoint, status)
        self.metrics.observe_e2e(job.tenant_id, runtime.name, time.monotonic() - job.arrived)
        self.metrics.observe_usage(
            job.tenant_id, job.prompt_tokens, job.cached_tokens, job.completion_tokens
        )
        counts = {
            "prompt_tokens": job.prompt_tokens,
            "cached_tokens": job.cached_tokens,
            "completion_tokens": job.completion_tokens,
        }
        job.spans.finish(status, counts)
        ttft = None if job.first_token_at is None else job.first_token_at - job.arrived
        record = UsageRecord(
            request_id=job.request_id,
            tenant_id=job.tenant_id,
            model=runtime.name if job.adapter is None else job.adapter.name,
            status=status,
            started_at=job.started_at,
            finished_at=datetime.now(UTC),
            key_id=job.ticket.principal.key_id,
            ttft_s=ttft,
            batch_id=job.ticket.principal.batch_id,
            **counts,
        )
        trail = job.trail or RequestTrail(job.request_id, job.endpoint, job.arrived)
        trail.finished(
            status=CLIENT_CLOSED if status == "disconnect" else job.http_status,
            outcome=status,
            completion_id=job.request_id,
            ttft_s=ttft,
            finish_reason=job.finish_reason,
            **counts,
        )
        job.usage_task = self._spawn(self._record(job.ticket, record))

    def _leave(self, engine_tenant_id: str) -> None:
        left = self.tenant_requests[engine_tenant_id] - 1
        if left > 0:
            self.tenant_requests[engine_tenant_id] = left
        else:
            del self.tenant_requests[engine_tenant_id]

    async def _record(self, ticket: Ticket, record: UsageRecord) -> None:
        try:
            await self.tenancy.complete(ticket, record)
        except Exception:
            log.exception("usage_record_failed", request_id=record.request_id)

    async def _abandon(
        self, admission: asyncio.Future[Ticket], principal: Principal, request_id: str, model: str
    ) -> None:
        """Record a request cancelled during its admission as a disconnect that computed
        nothing, once the admission it left behind has ended (nothing to do if it failed)."""
        try:
            ticket = await admission
        except Exception:
            return
        now = datetime.now(UTC)
        record = UsageRecord(
            request_id=request_id,
            tenant_id=principal.tenant_id,
            model=model,
            prompt_tokens=0,
            cached_tokens=0,
            completion_tokens=0,
            status="disconnect",
            started_at=now,
            finished_at=now,
            key_id=principal.key_id,
            batch_id=principal.batch_id,
        )
        await self._record(ticket, record)

    async def wait_recorded(self, job: Job) -> None:
        """Wait for the usage event; shielded, so a cancellation here cannot lose it."""
        if job.usage_task is not None:
            await asyncio.shield(job.usage_task)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @staticmethod
    async def _maybe_await(result: object) -> None:
        if inspect.isawaitable(result):
            await result

    async def drain(self, grace_s: float) -> None:
        """Refuse new work, let running requests finish within ``grace_s``, then abort the rest."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id, job in list(self.active.items()):
            log.warning("request_aborted_on_shutdown", request_id=request_id)
            for choice in job.choices:  # each engine request (a choice's, when n > 1)
                if choice.finish_reason is None:
                    await self._maybe_await(self._runtime_of(job).engine.abort(choice.request_id))
        while self.active and time.monotonic() < deadline + 5.0:
            await asyncio.sleep(0.05)
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=5.0)


def _choices(
    request_id: str, prompts: list[tuple[list[int], SamplingParams]], n: int
) -> list[Choice]:
    """``n`` choices per prompt, indexed prompt-major as OpenAI numbers them; a seeded request's
    later choices take the next seeds, so they differ from each other yet stay reproducible (an
    engine sent a prompt's first choice with ``n`` makes the same choices of it again)."""
    single = len(prompts) == 1 and n == 1
    choices: list[Choice] = []
    for ids, params in prompts:
        first: str | None = None
        for j in range(n):
            index = len(choices)
            engine_id = request_id if single else f"{request_id}-{index}"
            seeded = (
                params
                if j == 0 or params.seed is None
                else replace(params, seed=(params.seed + j) % 2**63)
            )
            choices.append(Choice(index, engine_id, ids, seeded, prefill_after=first))
            first = first or engine_id
    return choices


def _prompt_groups(choices: list[Choice]) -> list[list[Choice]]:
    """The choices by prompt, in order: a prompt's first choice, then the siblings waiting for
    it (``_choices`` makes a prompt's choices its first's settings, later seeds following)."""
    groups: dict[str, list[Choice]] = {}
    for choice in choices:
        groups.setdefault(choice.prefill_after or choice.request_id, []).append(choice)
    return list(groups.values())


async def provide_generation(state: State) -> GenerationService:
    """The app's generation service, for Litestar's dependency injection (``generation``)."""
    service: GenerationService | None = state.get("generation")
    if service is None:  # asked before the lifespan has started the engines
        raise ApiError(
            503, "The server is starting.", code="starting", headers={"Retry-After": "1"}
        )
    return service
