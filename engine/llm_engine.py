"""The synchronous engine: validate and queue requests, then step (schedule → run → postprocess).

With overlapped steps (``engine/overlap.py``) a decode step's results are postprocessed by the
next call, once it has launched the step that follows. Not thread-safe: one thread (the
AsyncEngine's loop, or a test) calls everything.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import structlog
import torch

from engine.attention.backend import AttentionBackend
from engine.attention.registry import create_backend
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, FixedPlanner, default_sizes, memory_estimate
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError, PromptTooLongError
from engine.fair_share import FairSharePolicy
from engine.kv_budget import free_memory, size_kv_pool
from engine.load_progress import LoadProgress, NullProgress
from engine.logits_processing import RowState, TokenHistory, process_logits
from engine.logprobs import RawLogprobs, take_raw
from engine.logprobs import gather as gather_logprobs
from engine.lora.adapter import LoraAdapter
from engine.lora.manager import LoraManager
from engine.model.loader import LoadedModel
from engine.model_runner import ModelRunner
from engine.outputs import GenerateRequest, RequestOutput, StepTrace, TokenLogprob
from engine.overlap import deferrable, fill_inputs, pending_inputs
from engine.policy import AdmissionPolicy
from engine.request import Request, RequestStatus, owner_tag
from engine.sampler import Sampler
from engine.sampling_table import TableCache
from engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from engine.speculative import NgramDrafter
from engine.stats import EngineSnapshot, EngineStats, StepTimer
from engine.step_calibration import measure_step_costs
from engine.step_target import StepTarget
from engine.transfers import Download
from radix_cache.errors import IsolationError
from radix_cache.page_pool import PagePool
from radix_cache.prefix_cache import (
    PUBLIC_NAMESPACE,
    NoPrefixCache,
    PrefixCache,
    adapter_namespace,
    tenant_namespace,
)

if TYPE_CHECKING:
    from engine.structured.masks import StepMask
    from engine.structured.runtime import StructuredOutput

log = structlog.get_logger(__name__)

PrefixCacheFactory = Callable[[PagePool, int], PrefixCache]
# Decode-only steps: replayed from CUDA graphs, run padded over the graphs' static buffers
# without capture (any device), or run as every other step.
GraphMode = Literal["capture", "eager", "off"]


@dataclass(slots=True)
class _Batch:
    """One step's work as it moves from schedule through run to postprocess."""

    out: SchedulerOutput
    seqs: list[ScheduledSeq]  # scheduled, and past the isolation check
    sampled: list[ScheduledSeq]  # of those, the ones that take a token this step
    outputs: list[RequestOutput]  # what the step returns, gathered as it goes
    chosen: torch.Tensor | None = None  # [num_rows] int64 on the device, one per logits row
    raw: RawLogprobs | None = None  # the raw logprobs of the rows that asked for them
    error: str | None = None  # the forward pass failed: the step's requests end with it
    token_ids: list[int] = field(default_factory=list)  # one per logits row of ``sampled``
    row_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)  # by logits row
    # In flight (overlapped): its ids on their way to the host, its step's start (perf_counter,
    # and epoch ns for traces), and once the scheduler has moved past it, each placeholder's row.
    ids: Download | None = None
    started: float = 0.0
    start_ns: int = 0
    rows: dict[Request, int] = field(default_factory=dict)


class LLMEngine:
    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        prefix_cache_factory: PrefixCacheFactory | None = None,
        policy: AdmissionPolicy | None = None,
        backend: AttentionBackend | None = None,
        progress: LoadProgress | None = None,
        decode_graphs: GraphMode | None = None,
        overlap: bool | None = None,
    ) -> None:
        """``progress`` is told of the KV cache's allocation, the graphs' capture and the timed
        warm-up steps. ``decode_graphs`` None means "capture" on CUDA with
        ``config.cuda_graphs``, else "off" (``engine/cuda_graphs.py``). ``overlap`` None means
        ``config.overlap_steps`` on CUDA, off elsewhere (``engine/overlap.py``); True forces it
        on any device."""
        progress = progress or NullProgress()
        self.config = config = config or EngineConfig()
        model_config = loaded.config
        self.vocab_size = model_config.vocab_size
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = tuple(model_config.eos_token_ids)
        device = loaded.model.embed_tokens.weight.device
        dtype = loaded.dtype
        page_size = config.page_size
        bytes_per_page = (
            (2 * page_size * model_config.num_kv_heads * model_config.head_dim)
            * model_config.num_layers
            * torch.empty((), dtype=dtype).element_size()
        )
        self.max_model_len = config.resolve_max_model_len(model_config.max_position_embeddings)
        if decode_graphs is None:
            decode_graphs = "capture" if config.cuda_graphs and device.type == "cuda" else "off"
        if overlap is None:
            overlap = config.overlap_steps and device.type == "cuda"
        self.overlap = overlap  # decode steps' results are read after the next step launched
        graph_sizes = config.cuda_graph_sizes or default_sizes(config.max_num_seqs)
        # The graphs are captured over the KV cache, so after it: their memory is estimated
        # and taken from the KV budget first.
        reserved = 0
        if decode_graphs == "capture":
            reserved = memory_estimate(model_config, graph_sizes, dtype, bytes_per_page)
        self.num_pages = self._size_pool(config, bytes_per_page, device, reserved)
        scratch = decode_graphs != "off"  # one page past the pool for padded rows
        progress.stage("allocate KV cache", total=self.num_pages * bytes_per_page, unit="bytes")
        pool = PagePool(self.num_pages)
        if prefix_cache_factory is not None and config.enable_prefix_cache:
            self.cache = prefix_cache_factory(pool, page_size)
        else:
            self.cache = NoPrefixCache(pool, page_size)
        policy = policy or FairSharePolicy()
        policy.bind_prefix_len(self._cached_prefix_len)
        self.drafter = (
            NgramDrafter(config.speculative_tokens, config.speculative_ngram)
            if config.speculative_tokens > 0
            else None
        )
        self.scheduler = Scheduler(
            self.cache,
            policy,
            config.token_budget,
            config.max_num_seqs,
            self.drafter,
            config.speculative_max_batch,
        )
        self._shares: dict[str, float | None] = {}  # per tenant namespace, as last applied
        self.runner = ModelRunner(
            loaded.model,
            model_config,
            backend=backend
            or create_backend(
                device,
                model_config,
                page_size=page_size,
                dtype=dtype,
                num_pages=self.num_pages + scratch,
                prefill_kernel=config.prefill_kernel,
            ),
            num_pages=self.num_pages,
            page_size=page_size,
            dtype=dtype,
            device=device,
            on_allocated=progress.advance,
            scratch_page=scratch,
        )
        self.lora: LoraManager | None = None
        if config.max_loras > 0:
            self.lora = LoraManager(
                model_config, config.max_loras, config.max_lora_rank, dtype, device
            )
            self.runner.lora = self.lora
            self.scheduler.lora_slots = self.lora.slots
        if decode_graphs != "off":
            self._decode_graphs(decode_graphs, graph_sizes, reserved, progress)
        self.scheduler.target = self._step_target(config, progress)
        ttft = config.target_ttft_ms
        self.scheduler.ttft_target_s = None if ttft is None else ttft / 1000
        self.sampler = Sampler()
        self.sampling_tables = TableCache(device)  # the last batch's sampling settings
        self.structured: StructuredOutput | None = None  # built by the first constrained request
        self.stats = EngineStats()
        self._requests: dict[str, Request] = {}  # live requests only
        self._pending: list[RequestOutput] = []  # aborts, returned by the next step
        # Requests waiting for a sibling's prompt to be computed (``prefill_after``), by sibling.
        self._held: dict[str, list[Request]] = {}
        self._held_by: dict[str, str] = {}  # held request id -> the sibling it waits for
        self._num_arrivals = 0
        self._traced = False  # a traced request came: steps are noted from now on
        self._inflight: _Batch | None = None  # an overlapped step whose ids are not read yet
        self._results_at = 0.0  # when the last step's results were read (perf_counter)
        log.info(
            "engine_ready",
            model=loaded.name,
            num_pages=self.num_pages,
            page_size=page_size,
            max_num_batched_tokens=config.token_budget,
            max_model_len=self.max_model_len,
            cache=type(self.cache).__name__,
        )

    def _size_pool(
        self, config: EngineConfig, bytes_per_page: int, device: torch.device, reserved: int
    ) -> int:
        """The KV pool's pages (``engine/kv_budget.py``), logged with the tokens they hold;
        ``reserved`` bytes of a budget sized by memory go to the decode graphs."""
        sized_by_memory = config.num_pages is None and config.kv_cache_bytes is None
        free = free_memory(device) if sized_by_memory else None
        size = size_kv_pool(config, bytes_per_page, self.max_model_len, device.type, free, reserved)
        emit = log.warning if size.reason == "fallback" else log.info
        emit(
            "kv_cache_sized",
            num_pages=size.num_pages,
            num_tokens=size.num_pages * config.page_size,
            kv_cache_bytes=size.num_pages * bytes_per_page,
            reason=size.reason,
            memory_fraction=size.fraction,
            free_bytes=size.free_bytes,
            reserved_bytes=reserved if size.free_bytes is not None else None,
            device=device.type,
        )
        return size.num_pages

    def _decode_graphs(
        self, mode: GraphMode, sizes: tuple[int, ...], reserved: int, progress: LoadProgress
    ) -> None:
        """Static buffers for decode-only steps, and with "capture" their CUDA graphs; a
        backend that cannot plan into fixed buffers, or a capture that fails, leaves every step
        eager (logged as ``cuda_graphs_off``)."""
        runner = self.runner
        if mode == "capture" and not isinstance(runner.backend, FixedPlanner):
            log.warning(
                "cuda_graphs_off",
                reason=f"the {runner.backend.name} attention backend cannot replay from graphs",
            )
            return
        assert runner.scratch_page is not None
        graphs = DecodeGraphs(
            runner.model,
            runner.backend,
            runner.kv_caches,
            sizes=sizes,
            page_size=runner.page_size,
            scratch_page=runner.scratch_page,
            max_pages_per_seq=-(-self.max_model_len // runner.page_size),
        )
        if mode == "capture":
            start = time.perf_counter()
            try:
                used = graphs.capture(progress)
            except Exception as exc:  # a model the graphs cannot hold still serves, eagerly
                log.warning("cuda_graphs_off", reason=f"capture failed: {exc!r}")
                return
            log.info(
                "cuda_graphs_captured",
                sizes=list(sizes),
                seconds=round(time.perf_counter() - start, 2),
                device_bytes=used,
                reserved_bytes=reserved,
            )
        runner.graphs = graphs

    def _step_target(self, config: EngineConfig, progress: LoadProgress) -> StepTarget | None:
        """The step-time target of ``config``, with this machine's measured step costs."""
        if config.target_tpot_ms is None:
            return None
        try:
            costs = measure_step_costs(
                self.runner,
                self.cache.pool,
                config.max_num_seqs,
                config.token_budget,
                progress,
                self.max_model_len,
            )
        except ValueError as exc:
            log.warning("step_target_off", reason=str(exc))
            return None
        auto = config.target_tpot_ms == "auto"
        target_s = costs.auto_target_s() if auto else float(config.target_tpot_ms) / 1000
        target = StepTarget(target_s, costs, min_prefill_tokens=config.page_size)
        log.info(
            "step_target",
            target_tpot_ms=round(target_s * 1000, 1),
            derived=auto,
            fixed_ms=round(costs.fixed_s * 1000, 2),
            per_decode_ms=round(costs.per_decode_s * 1000, 3),
            per_context_token_us=round(costs.per_context_token_s * 1e6, 3),
            per_prefill_token_ms=round(costs.per_prefill_token_s * 1000, 4),
            max_decodes=target.max_decodes,
        )
        return target

    # -- requests ---------------------------------------------------------------------------

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending) or self._inflight is not None

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def _unpublish(self, request: GenerateRequest) -> None:
        """Release a public prefix now; the request's one output comes with the next step."""
        if request.request_id in self._requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running")
        released = self.cache.unpublish(request.prompt_token_ids)
        log.info("public_prefix_released", num_tokens=released)
        self._pending.append(
            RequestOutput(
                request.request_id,
                finished=True,
                finish_reason="stop",
                num_prompt_tokens=len(request.prompt_token_ids),
                num_published_tokens=released,
            )
        )

    def add_request(self, request: GenerateRequest) -> None:
        """Validate and queue; raises InvalidRequestError (or PromptTooLongError) on bad input.

        An ``unpublish`` request only releases its public prefix; it finishes with the next step.
        """
        if request.unpublish:
            self._unpublish(request)
            return
        self._validate(request)
        params = request.params
        generator: torch.Generator | None = None
        if params.seed is not None and not params.is_greedy:
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        namespace = PUBLIC_NAMESPACE if request.publish else tenant_namespace(request.tenant_id)
        adapter = self._adapter(request)
        if adapter is not None:  # public prefixes hold the base model's KV: never matched here
            namespace = adapter_namespace(request.tenant_id, adapter.name)
        state = Request(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            params=params,
            tenant_id=request.tenant_id,
            namespace=namespace,
            owner=owner_tag(request.request_id),
            arrival_index=self._num_arrivals,
            tenant_weight=request.tenant_weight,
            allow_public_prefix=request.allow_public_prefix and adapter is None,
            background=request.background,
            tenant_requests=request.tenant_requests,
            arrived_at=request.arrived_at,
            generator=generator,
            publish=request.publish,
            lora=adapter,
            steps=[] if request.trace_steps else None,
        )
        self._traced = self._traced or request.trace_steps
        self._apply_share(state, request.kv_cache_share)
        state.detokenizer = IncrementalDetokenizer(
            self.tokenizer, params, request.prompt_token_ids, self.eos_token_ids
        )
        if params.grammar is not None:
            if self.structured is None:  # xgrammar loads with the first constrained request
                from engine.structured.runtime import (  # noqa: PLC0415 (lazy: xgrammar, triton)
                    StructuredOutput,
                )

                self.structured = StructuredOutput(
                    self.tokenizer.hf, self.vocab_size, self.eos_token_ids
                )
            state.grammar = self.structured.state_for(params.grammar, params.ignore_eos)
        if params.processes_logits:
            state.history = TokenHistory.of(
                params, state.prompt_token_ids, self.eos_token_ids, self.vocab_size,
                self.runner.device,
            )  # fmt: skip
        self._num_arrivals += 1
        self._requests[request.request_id] = state
        sibling = self._requests.get(request.prefill_after or "")
        if sibling is not None and sibling.num_computed_tokens < sibling.num_prompt_tokens:
            self._held.setdefault(sibling.request_id, []).append(state)
            self._held_by[state.request_id] = sibling.request_id
        else:
            self.scheduler.add(state)

    def _adapter(self, request: GenerateRequest) -> LoraAdapter | None:
        """The request's LoRA adapter, read (and checked) now so a bad one fails at once."""
        if request.lora_name is None:
            return None
        if self.lora is None:
            raise InvalidRequestError("LoRA adapters are not enabled on this engine", "model")
        if request.publish:
            raise InvalidRequestError("a public prefix is computed by the base model", "model")
        return self.lora.get(request.lora_name, request.lora_path)

    def _release_held(self) -> None:
        """Queue the requests whose sibling has computed its prompt (or ended)."""
        for sibling_id in list(self._held):
            sibling = self._requests.get(sibling_id)
            if sibling is None or sibling.num_computed_tokens >= sibling.num_prompt_tokens:
                for request in self._held.pop(sibling_id):
                    del self._held_by[request.request_id]
                    self.scheduler.add(request)

    def _apply_share(self, request: Request, share: float | None) -> None:
        """Keep the cache's per-tenant cap in step with the tenant's quota as requests bring it."""
        namespace = request.namespace
        if request.publish or self._shares.get(namespace, None) == share:
            return  # unchanged (a tenant never capped has None, like "unlimited")
        self._shares[namespace] = share
        self.cache.set_share(request.namespace, share, request.tenant_weight)

    def _cached_prefix_len(self, request: Request) -> int:
        """Tokens of the request's prompt cached in its own namespace (or public), for ordering."""
        tokens = request.all_token_ids[:-1]
        return self.cache.match(request.namespace, tokens, request.allow_public_prefix).num_tokens

    def _validate(self, request: GenerateRequest) -> None:
        if request.request_id in self._requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running")
        prompt = request.prompt_token_ids
        if not prompt:
            raise InvalidRequestError("the prompt is empty", "prompt")
        request.params.validate()
        if any(t >= self.vocab_size for t, _ in request.params.logit_bias):
            raise InvalidRequestError(
                f"logit_bias token ids must be in [0, {self.vocab_size})", "logit_bias"
            )
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {self.vocab_size})", "prompt"
            )
        total = len(prompt) + request.params.max_tokens
        if total > self.max_model_len:
            raise PromptTooLongError(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({request.params.max_tokens}) "
                f"exceeds the model's context of {self.max_model_len} tokens",
                "max_tokens" if len(prompt) < self.max_model_len else "prompt",
            )
        capacity = self.num_pages * self.config.page_size
        if len(prompt) > capacity:
            raise PromptTooLongError(
                f"prompt ({len(prompt)} tokens) exceeds the KV cache ({capacity} tokens)", "prompt"
            )

    def drop_tenant(self, tenant_id: str) -> int:
        """Free every unlocked cached page of a (deleted) tenant, its adapters' namespaces
        included; returns how many."""
        own = tenant_namespace(tenant_id)
        adapters = adapter_namespace(tenant_id, "")
        names = [own, *(ns for ns in self.cache.stats() if ns.startswith(adapters))]
        return sum(self.cache.drop_namespace(ns) for ns in names)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its pages; its final output comes with the next step."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        sibling_id = self._held_by.pop(request_id, None)
        if sibling_id is not None:  # never queued
            self._held[sibling_id].remove(request)
            if not self._held[sibling_id]:
                del self._held[sibling_id]
            request.status = RequestStatus.FINISHED
            request.finish_reason = "abort"
        else:
            self.scheduler.finish(request, "abort")
        self.stats.num_aborted += 1
        self._pending.append(self._output(request, [], "", "abort"))
        return True

    def abort_all(self) -> int:
        """Abort every live request (their final outputs come with the next step)."""
        request_ids = list(self._requests)
        for request_id in request_ids:
            self.abort(request_id)
        return len(request_ids)

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step: schedule → run → postprocess, each phase timed into ``self.stats``.

        With overlap, a step that may stay in flight (``overlap.deferrable``) is postprocessed
        by the next call: that one moves the scheduler past it first (placeholders for its
        tokens), schedules and launches the next step, and only then reads its ids; a call
        returns the outputs of the step it read."""
        timer = StepTimer(self.stats, wall_clock=self._traced)
        if self._inflight is not None:
            self._advance(self._inflight)
        outputs = self._take_pending()
        batch = self._schedule(outputs, timer)
        if batch.seqs:
            self._run(batch, timer)
        if self._settle(outputs):
            timer.lap("postprocess")
        if batch.error is not None:
            for seq in batch.seqs:
                if self._requests.get(seq.request.request_id) is seq.request:
                    outputs.append(self._fail(seq.request, batch.error))
        elif batch.seqs:
            if self.overlap and deferrable(batch.out, batch.seqs, self.max_model_len):
                self._defer(batch, timer)
            else:
                self._postprocess(batch, timer)
        return outputs

    def _take_pending(self) -> list[RequestOutput]:
        """The outputs owed since the last step (aborts); held siblings join the queue."""
        outputs, self._pending = self._pending, []
        if self._held:
            self._release_held()
        return outputs

    def _schedule(self, outputs: list[RequestOutput], timer: StepTimer) -> _Batch:
        out = self.scheduler.schedule()
        timer.lap("schedule")
        self.stats.num_preemptions += len(out.preempted)
        if any(request.token_in_flight for request in out.finished):
            self._settle(outputs)  # its last token is delivered before it ends
        for request in out.finished:  # outgrew the whole KV cache
            if self._requests.get(request.request_id) is request:
                reason = request.finish_reason or "length"
                outputs.append(self._finish(request, [], reason, done=True))
        seqs = [seq for seq in out.seqs if self._check_isolation(seq, outputs)]
        return _Batch(out, seqs, [seq for seq in seqs if seq.sample], outputs)

    def _run(self, batch: _Batch, timer: StepTimer) -> None:
        """The forward pass and the choice of tokens, left on the device; ``batch.error`` when
        the model failed. Inputs that are the step in flight's tokens come from its ids."""
        inputs = self.runner.prepare(batch.seqs)
        inflight = self._inflight
        if inflight is not None and inflight.chosen is not None:
            positions, sources = pending_inputs(batch.seqs, inflight.rows)
            fill_inputs(inputs.input_ids, positions, sources, inflight.chosen)
        timer.lap("metadata")
        sampled = batch.sampled
        # Grammar masks are filled on a worker thread while the forward pass runs.
        mask = self.structured.start(sampled) if self.structured is not None else None
        try:
            logits = self.runner.forward(inputs)
        except Exception as exc:  # one bad step errors its requests, never the engine
            log.error("step_failed", error=repr(exc), num_seqs=len(batch.seqs))
            batch.error = f"model step failed: {exc}"
            return
        timer.lap("forward")
        if sampled:
            batch.chosen, batch.raw = self._choose(sampled, logits, mask)

    def _defer(self, batch: _Batch, timer: StepTimer) -> None:
        """Leave a launched step in flight: its ids start for the host, unwaited for."""
        if batch.chosen is None:
            raise RuntimeError("a deferred step chose no tokens")
        batch.ids = Download(batch.chosen)
        timer.lap("sample")
        timer.finish()
        batch.started, batch.start_ns = timer.started, timer.start_ns
        self.stats.num_overlapped_steps += 1
        self._inflight = batch

    def _advance(self, batch: _Batch) -> None:
        """Move the scheduler past the step in flight as if its ids were known: each of its
        running requests takes a placeholder token (``_settle`` gives the ids)."""
        self._count_tokens(batch.out, batch.seqs, {})
        if self._traced:
            self._trace_steps(batch.out, batch.seqs, {}, batch.start_ns)
        self.scheduler.postprocess(batch.out)
        for row, seq in enumerate(batch.sampled):
            request = seq.request
            if request.status is RequestStatus.RUNNING:
                request.append_placeholder()
                batch.rows[request] = row

    def _settle(self, outputs: list[RequestOutput]) -> bool:
        """Read the step in flight's ids (the wait for the device) and append its tokens, as a
        synchronous step would; requests that ended meanwhile drop theirs. False when none."""
        batch = self._inflight
        if batch is None or batch.ids is None:
            return False
        self._inflight = None
        token_ids = batch.ids.wait()
        for request, row in batch.rows.items():
            if self._requests.get(request.request_id) is request:
                outputs.append(self._append_tokens(request, [token_ids[row]], in_flight=True))
        self._observe(batch.out, batch.started, time.perf_counter())
        return True

    def _postprocess(self, batch: _Batch, timer: StepTimer) -> None:
        """Read the tokens, accept drafts, count and trace, advance the scheduler, append the
        new tokens."""
        out, seqs, sampled = batch.out, batch.seqs, batch.sampled
        if sampled and batch.chosen is not None:
            # The step's one copy from the device.
            batch.token_ids, batch.row_logprobs = gather_logprobs(batch.chosen, batch.raw)
        timer.lap("sample")
        new_tokens, rejected = self._verify(sampled, batch.token_ids)
        self._count_tokens(out, seqs, rejected)
        if self._traced:
            self._trace_steps(out, seqs, rejected, timer.start_ns)
        self.scheduler.postprocess(out, rejected)
        row = 0
        for seq, tokens in zip(sampled, new_tokens, strict=True):
            request = seq.request
            rows = 1 + len(seq.draft)
            if request.is_finished:  # ended by the step that was in flight: one token too many
                row += rows
                continue
            logprobs = None
            if request.params.logprobs is not None:
                logprobs = [batch.row_logprobs[row + j] for j in range(len(tokens))]
            row += rows
            batch.outputs.append(self._append_tokens(request, tokens, logprobs))
        timer.finish()
        self._observe(out, timer.started, timer.last)

    def _observe(self, out: SchedulerOutput, started: float, end: float) -> None:
        """Tell the step-time target a step's time: from its start, or from when the step
        before's results were read if later (its preparation overlapped that step), to ``end``,
        when its own results were."""
        seconds = end - max(started, self._results_at)
        self._results_at = end
        target = self.scheduler.target
        if target is not None:
            context = sum(seq.request.num_computed_tokens for seq in out.seqs[: out.num_decodes])
            target.observe(
                out.num_decodes, out.num_batched_tokens - out.num_decodes, seconds, context
            )

    def _choose(
        self,
        sampled: list[ScheduledSeq],
        logits: torch.Tensor,  # [num_rows, vocab_size]
        mask: Future[StepMask] | None = None,
    ) -> tuple[torch.Tensor, RawLogprobs | None]:  # [num_rows] int64 on the device
        """The chosen token of every logits row, left on the device, and the raw logprobs of
        the rows that asked for them; the batch's settings come from its sampling table."""
        table = self.sampling_tables.table_for(sampled, logits.shape[1])
        raw = take_raw(logits, table.logprobs) if table.logprobs is not None else None
        if mask is not None and self.structured is not None:  # after the raw logprobs
            logits = logits.float()
            self.structured.apply(logits, mask)
        if table.has_history:
            logits = process_logits(logits, _row_states(sampled))
        return self.sampler.choose(logits, table), raw

    def _check_isolation(self, seq: ScheduledSeq, outputs: list[RequestOutput]) -> bool:
        request = seq.request
        try:
            self.cache.check_owner(request.block_table, request.namespace, request.owner)
        except IsolationError as exc:
            log.error("isolation_violation", request_id=request.request_id, error=str(exc))
            outputs.append(self._fail(request, "internal isolation check failed"))
            return False
        return True

    def _verify(
        self, sampled: list[ScheduledSeq], token_ids: list[int]
    ) -> tuple[list[list[int]], dict[Request, int]]:
        """Each sampled sequence's new tokens: a draft counts up to the first token the model
        did not choose, then the model's own choice follows; also the rejected draft tokens per
        request (their KV is stale)."""
        new_tokens: list[list[int]] = []
        rejected: dict[Request, int] = {}
        row = 0
        for seq in sampled:
            draft = seq.draft
            if not draft:
                new_tokens.append([token_ids[row]])
                row += 1
                continue
            chosen = token_ids[row : row + len(draft) + 1]
            num_accepted = 0
            while num_accepted < len(draft) and draft[num_accepted] == chosen[num_accepted]:
                num_accepted += 1
            new_tokens.append(chosen[: num_accepted + 1])
            rejected[seq.request] = len(draft) - num_accepted
            if self.drafter is not None:
                self.drafter.feedback(seq.request, len(draft), num_accepted)
            self.stats.num_draft_tokens += len(draft)
            self.stats.num_accepted_draft_tokens += num_accepted
            row += len(draft) + 1
        return new_tokens, rejected

    def _count_tokens(
        self, out: SchedulerOutput, seqs: list[ScheduledSeq], rejected: dict[Request, int]
    ) -> None:
        for seq in seqs:
            request = seq.request
            if seq.draft:
                self.stats.num_decode_tokens += seq.num_new_tokens - rejected.get(request, 0)
            elif seq.num_new_tokens == 1 and request.num_output_tokens > 0 and seq.sample:
                self.stats.num_decode_tokens += 1
            else:
                self.stats.num_prefill_tokens += seq.num_new_tokens
            if (
                request.num_computed_tokens == request.num_cached_tokens
                and request.num_output_tokens == 0
            ):
                self.stats.num_cached_tokens += request.num_cached_tokens

    def _trace_steps(
        self,
        out: SchedulerOutput,
        seqs: list[ScheduledSeq],
        rejected: dict[Request, int],
        start_ns: int,
    ) -> None:
        """Note this step on each traced request in it (reported with its next output)."""
        end_ns = time.time_ns()
        for seq in seqs:
            request = seq.request
            if request.steps is None:
                continue
            decode = bool(seq.draft) or (
                seq.num_new_tokens == 1 and request.num_output_tokens > 0 and seq.sample
            )
            request.steps.append(
                StepTrace(
                    "decode" if decode else "prefill",
                    start_ns,
                    end_ns,
                    seq.num_new_tokens - rejected.get(request, 0),
                    len(seqs),
                    out.num_batched_tokens,
                )
            )

    def _append_tokens(
        self,
        request: Request,
        token_ids: list[int],
        logprobs: list[TokenLogprob] | None = None,
        in_flight: bool = False,
    ) -> RequestOutput:
        """Append a step's tokens (more than one when a draft was accepted) until one ends the
        request; one output carries them all. ``in_flight``: the one token is the request's
        placeholder's id (``Request.settle_token``)."""
        detokenizer = request.detokenizer
        if detokenizer is None:
            raise RuntimeError("request without detokenizer")
        text = ""
        reason: str | None = None
        appended: list[int] = []
        for token_id in token_ids:
            grammar = request.grammar
            if grammar is not None and not grammar.accept(token_id):
                return self._fail(request, grammar.error or "the output left its grammar")
            if in_flight:
                request.settle_token(token_id)
            else:
                request.append_token(token_id)
            appended.append(token_id)
            self.stats.num_generated_tokens += 1
            piece, reason = detokenizer.update(token_id, request.num_output_tokens)
            text += piece
            if reason is None and (
                request.num_tokens >= self.max_model_len or (grammar is not None and grammar.closed)
            ):  # a grammar closed early for max_tokens ends the output as "length" too
                reason = "length"
                text += detokenizer.flush()
            if reason is not None:
                break
        if logprobs is not None:
            logprobs = logprobs[: len(appended)]
        if reason is None:
            output = self._output(request, appended, text, None)
        else:
            # Accepted draft tokens after the end have KV but are not the request's tokens.
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
            output = self._finish(request, appended, reason, text=text)
        output.logprobs = logprobs
        return output

    def _finish(
        self,
        request: Request,
        token_ids: list[int],
        reason: str,
        text: str = "",
        done: bool = False,
    ) -> RequestOutput:
        if not done:
            self.scheduler.finish(request, reason)
        if request.detokenizer is not None:
            text += request.detokenizer.flush()
        self._requests.pop(request.request_id, None)
        self.stats.num_finished += 1
        # The gateway writes the request's one line (request_done); this is the engine's view.
        log.debug(
            "engine_request_finished",
            request_id=request.request_id,
            tenant_id=request.tenant_id,
            finish_reason=reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_output_tokens=request.num_output_tokens,
            num_preemptions=request.num_preemptions,
        )
        return self._output(request, token_ids, text, reason)

    def _fail(self, request: Request, message: str) -> RequestOutput:
        if request.status is not RequestStatus.FINISHED:
            self.scheduler.finish(request, "error")
        self._requests.pop(request.request_id, None)
        output = self._output(request, [], "", "error")
        output.error = message
        return output

    def _output(
        self, request: Request, token_ids: list[int], text: str, reason: str | None
    ) -> RequestOutput:
        steps = request.steps
        if steps:
            request.steps = []
        return RequestOutput(
            request_id=request.request_id,
            token_ids=token_ids,
            text=text,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_output_tokens=request.num_output_tokens,
            num_published_tokens=request.num_published_tokens,
            steps=steps or None,
        )

    # -- introspection ---------------------------------------------------------------------------

    def snapshot(self) -> EngineSnapshot:
        """Running/waiting per tenant and their adapters, pages and counters; O(live requests),
        not per step."""
        running: dict[str, int] = {}
        for request in self.scheduler.running:
            running[request.tenant_id] = running.get(request.tenant_id, 0) + 1
        # Ordered sets, in arrival order: one pass over the live requests, none without LoRA.
        adapters: dict[RequestStatus, dict[str, None]] = {status: {} for status in RequestStatus}
        if self.lora is not None:
            for request in self._requests.values():
                if request.lora is not None:
                    adapters[request.status][request.lora.name] = None
        return EngineSnapshot(
            running_by_tenant=running,
            waiting_by_tenant=self.scheduler.policy.num_waiting_by_tenant(),
            queue_wait_by_tenant=self.scheduler.queue_wait_by_tenant(),
            num_pages_total=self.num_pages,
            num_pages_free=self.cache.pool.num_free_pages,
            num_pages_available=self.cache.num_available_pages,
            page_size=self.config.page_size,
            counters=self.stats.copy(),
            cache_by_namespace=self.cache.stats(),
            max_loras=self.config.max_loras,
            running_lora_adapters=tuple(adapters[RequestStatus.RUNNING]),
            waiting_lora_adapters=tuple(adapters[RequestStatus.WAITING]),
            taken_at=time.time(),
        )


def _row_states(sampled: list[ScheduledSeq]) -> list[RowState]:
    """Each logits row's request settings, history and output so far, for logit processing."""
    states = []
    for seq in sampled:
        request = seq.request
        if request.history is not None:  # never drafted (engine/speculative.py)
            states.append(RowState(request.params, request.history, request.num_output_tokens))
        else:
            states.extend([RowState(request.params, None, 0)] * (1 + len(seq.draft)))
    return states
