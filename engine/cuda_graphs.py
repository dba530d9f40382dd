"""Decode-only steps replayed from CUDA graphs, one graph per padded batch size.

A decode step on a GPU costs its kernel launches and its Python, not its arithmetic (about 6 ms
whatever the batch up to 128 in bench/GPU.md, where the weights alone take 0.4 ms). A graph
captured at start replays a whole step's kernels in one launch. Its kernels read the addresses
they were captured with, so ``DecodeGraphs`` owns static buffers sized for its largest batch:
each step copies its token ids, positions and slots into them (one copy per dtype), the
attention backend's ``plan_fixed`` copies the page table into its own fixed buffers (planning
reads host lists, so it stays outside the graph), and the graph of the smallest captured size
that holds the step's rows replays.

Padding: the rows past the step's own read token 0 at position 0 and write their K/V to a
scratch page no request ever holds (one page past the pool's ids); their logits are dropped.

Only decode-only steps replay: a step with a prefill chunk, a draft or a row under a LoRA
adapter, or more rows than the largest size, runs eagerly as before. Without capture
(``capture`` never called, any device) the same buffers, padding and plan run the model
eagerly: the CPU tests hold that path token for token to the plain one.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.load_progress import LoadProgress, NullProgress
from engine.model.config import ModelConfig
from engine.model.llama import DecoderLayer, LlamaForCausalLM
from engine.scheduler import ScheduledSeq

FINE_UNTIL = 256  # the default sizes step by 8 up to here, by 16 past it
# FlashInfer's device int workspace, allocated by each CUDA-graph decode wrapper (one per size).
WRAPPER_WORKSPACE_BYTES = 8 * 2**20


def default_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 up to 256 and every 16 past it, and ``max_num_seqs`` itself:
    a step pads at most 15 rows, and every decode-only step has a graph."""
    sizes = [n for n in (1, 2, 4) if n < max_num_seqs]
    sizes += range(8, min(max_num_seqs, FINE_UNTIL) + 1, 8)
    sizes += range(FINE_UNTIL + 16, max_num_seqs + 1, 16)
    if sizes[-1:] != [max_num_seqs]:
        sizes.append(max_num_seqs)
    return tuple(sizes)


def padded_size(sizes: Sequence[int], num_rows: int) -> int | None:
    """The smallest of the increasing ``sizes`` that holds ``num_rows``; None past the largest."""
    i = bisect.bisect_left(sizes, num_rows)
    return sizes[i] if i < len(sizes) else None


def memory_estimate(
    config: ModelConfig, sizes: Sequence[int], dtype: torch.dtype, bytes_per_page: int
) -> int:
    """Device bytes the graphs are expected to take: the largest step's activations (graphs
    share one memory pool, captured largest first, so the smaller ones reuse its blocks), with
    room for the allocator's rounding; a FlashInfer workspace per size; the scratch page."""
    rows, elt = max(sizes), dtype.itemsize
    per_row = (
        4 * config.hidden_size  # the residual stream, its norm, attention and MLP outputs
        + 2 * config.q_size  # Q (inside the fused QKV) and the attention output
        + 2 * config.kv_size
        + 3 * config.intermediate_size  # gate and up, their product
        + 2 * config.head_dim  # the rows' RoPE tables
    ) * elt + config.vocab_size * (elt + 4)  # the logits, and in float32
    return 2 * rows * per_row + len(sizes) * WRAPPER_WORKSPACE_BYTES + bytes_per_page


@runtime_checkable
class FixedPlanner(Protocol):
    """An attention backend that plans decode steps into fixed buffers, one size at a time
    (``FlashInferAttentionBackend``); required for capture."""

    def fix_decode_sizes(self, sizes: Sequence[int], max_pages: int) -> None: ...

    def plan_fixed(self, meta: AttentionMetadata) -> None: ...


class DecodeRow(NamedTuple):
    token_id: int
    position: int  # the new token's; its K/V goes to this position's slot
    page_ids: Sequence[int]  # the sequence's block table


class GraphStep(NamedTuple):
    """A decode step staged in the static buffers: every tensor is a view of them."""

    size: int  # the captured batch size it pads to
    num_rows: int  # its own rows, first; the rest are padding
    input_ids: torch.Tensor  # [size] int64
    positions: torch.Tensor  # [size] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [size] int64: every row


def decode_rows(seqs: Sequence[ScheduledSeq]) -> list[DecodeRow] | None:
    """The step as decode rows, or None when it must run eagerly: a prefill chunk, a draft, a
    row that takes no token, or a row under a LoRA adapter (their products are per step)."""
    rows = []
    for seq in seqs:
        request = seq.request
        if seq.num_new_tokens != 1 or seq.draft or not seq.sample or request.lora_slot >= 0:
            return None
        position = request.num_computed_tokens
        rows.append(DecodeRow(request.all_token_ids[position], position, request.block_table))
    return rows


@contextmanager
def _own_scratch(model: LlamaForCausalLM) -> Iterator[None]:
    """The MLPs share a scratch buffer that a larger eager step replaces; a graph captured over
    it would write to freed memory then. While capturing they allocate from the graph's pool."""
    layers = [layer for layer in model.layers if isinstance(layer, DecoderLayer)]
    saved = [layer.mlp.scratch for layer in layers]
    for layer in layers:
        layer.mlp.scratch = None
    try:
        yield
    finally:
        for layer, scratch in zip(layers, saved, strict=True):
            layer.mlp.scratch = scratch


class DecodeGraphs:
    """Static buffers for decode steps up to ``max(sizes)`` rows, and the graphs over them."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        *,
        sizes: Sequence[int],
        page_size: int,
        scratch_page: int,
        max_pages_per_seq: int,
    ) -> None:
        """``scratch_page`` must be a page of every layer's cache that no request holds."""
        if not sizes or min(sizes) < 1:
            raise ValueError(f"graph sizes must be positive batch sizes, got {list(sizes)}")
        if not 0 <= scratch_page < kv_caches[0].shape[0]:
            raise ValueError(f"scratch page {scratch_page} is outside the KV cache")
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.sizes = tuple(sorted(set(sizes)))
        self.page_size = page_size
        self.scratch_page = scratch_page
        largest = self.sizes[-1]
        self.max_pages = largest * max(max_pages_per_seq, 1)
        self.device = device = kv_caches[0].device
        self._pin = device.type == "cuda"
        # [ids | positions | slots] and [kv_indptr | last page lengths | page ids], each laid
        # out for the step's size: a size's views always sit at the same addresses.
        self._longs = torch.zeros(3 * largest, dtype=torch.long, device=device)
        self._ints = torch.zeros(2 * largest + 1 + self.max_pages, dtype=torch.int32, device=device)
        self._qo_indptr = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self._logits_indices = torch.arange(largest, dtype=torch.long, device=device)
        self._staged: tuple[torch.Tensor, torch.Tensor] | None = None  # host copies in flight
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if isinstance(backend, FixedPlanner):
            backend.fix_decode_sizes(self.sizes, self.max_pages)

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def rows_for(self, seqs: Sequence[ScheduledSeq]) -> list[DecodeRow] | None:
        """The step's decode rows when it can run on the static buffers, else None."""
        size = padded_size(self.sizes, len(seqs))
        if not seqs or size is None:
            return None
        rows = decode_rows(seqs)
        if rows is None:
            return None
        pages = sum(-(-(r.position + 1) // self.page_size) for r in rows)
        return rows if pages + size - len(rows) <= self.max_pages else None

    def stage(self, rows: Sequence[DecodeRow], size: int | None = None) -> GraphStep:
        """Copy ``rows`` into the static buffers, padded to ``size`` (None: the smallest
        captured size that holds them), and return the step's views of them."""
        n, page = len(rows), self.page_size
        size = padded_size(self.sizes, n) if size is None else size
        if size is None or size not in self.sizes or size < n:
            raise ValueError(f"{n} rows do not fit a graph size of {self.sizes}")
        scratch = self.scratch_page
        pad = size - n
        ids = [r.token_id for r in rows] + [0] * pad
        positions = [r.position for r in rows] + [0] * pad
        slots = [r.page_ids[r.position // page] * page + r.position % page for r in rows]
        slots += [scratch * page] * pad
        kv_indptr, last, kv_lens = [0], [], []
        pages: list[int] = []
        for r in rows:
            kv_len = r.position + 1
            num_pages = -(-kv_len // page)
            if len(r.page_ids) < num_pages:
                raise ValueError(f"block table has {len(r.page_ids)} pages, needs {num_pages}")
            pages.extend(r.page_ids[:num_pages])
            kv_indptr.append(kv_indptr[-1] + num_pages)
            last.append(kv_len - (num_pages - 1) * page)
            kv_lens.append(kv_len)
        pages += [scratch] * pad
        kv_indptr += range(kv_indptr[-1] + 1, kv_indptr[-1] + pad + 1)
        last += [1] * pad
        kv_lens += [1] * pad
        total = len(pages)
        if total > self.max_pages:
            raise ValueError(f"{total} pages exceed the static page table's {self.max_pages}")
        longs = torch.tensor(ids + positions + slots, dtype=torch.long, pin_memory=self._pin)
        ints = torch.tensor(kv_indptr + last + pages, dtype=torch.int32, pin_memory=self._pin)
        self._longs[: 3 * size].copy_(longs, non_blocking=True)
        self._ints[: ints.shape[0]].copy_(ints, non_blocking=True)
        self._staged = (longs, ints)  # held until the next step has been staged
        table = self._ints
        bounds = None
        if self.device.type != "cpu":
            bounds = (min(pages), max(pages), min(slots), max(slots))
        meta = AttentionMetadata(
            qo_indptr=self._qo_indptr[: size + 1],
            kv_indptr=table[: size + 1],
            kv_indices=table[2 * size + 1 : 2 * size + 1 + total],
            kv_last_page_len=table[size + 1 : 2 * size + 1],
            slot_mapping=self._longs[2 * size : 3 * size],
            page_size=page,
            qo_lens=[1] * size,
            kv_lens=kv_lens,
            host_bounds=bounds,
        )
        return GraphStep(
            size,
            n,
            self._longs[:size],
            self._longs[size : 2 * size],
            meta,
            self._logits_indices[:size],
        )

    def _plan(self, meta: AttentionMetadata) -> None:
        if isinstance(self.backend, FixedPlanner):
            self.backend.plan_fixed(meta)
        else:
            self.backend.plan(meta)

    def _forward(self, step: GraphStep) -> torch.Tensor:  # [size, vocab] float32
        logits: torch.Tensor = self.model(
            step.input_ids,
            step.positions,
            step.meta,
            self.backend,
            self.kv_caches,
            step.logits_indices,
            plan=False,
        )
        return logits

    def run(self, step: GraphStep) -> torch.Tensor:  # [num_rows, vocab] float32
        """Plan the step (outside any graph), then replay its size's graph, or run the model
        over the static buffers where none was captured. The rows are the graph's output:
        read them before the next step runs."""
        self._plan(step.meta)
        captured = self._graphs.get(step.size)
        if captured is None:
            logits = self._forward(step)
        else:
            graph, logits = captured
            graph.replay()
        return logits[: step.num_rows]

    def capture(self, progress: LoadProgress | None = None) -> int:
        """Capture a graph for every size, largest first, all in one memory pool; returns the
        device bytes they took (graphs, their pool and anything capture allocated)."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        if not isinstance(self.backend, FixedPlanner):
            raise ValueError(f"the {self.backend.name} attention backend cannot plan for graphs")
        progress = progress or NullProgress()
        progress.stage("capture CUDA graphs", total=len(self.sizes), unit="graphs")
        device = self.device
        torch.cuda.synchronize(device)
        free_before, _ = torch.cuda.mem_get_info(device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        with _own_scratch(self.model):
            for size in reversed(self.sizes):
                step = self.stage([], size)  # padding alone: the scratch page
                self._plan(step.meta)
                # One eager run first, on the capture stream: lazy set-up stays out of the graph.
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    self._forward(step)
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self._forward(step)
                self._graphs[size] = (graph, logits)
                progress.advance()
        torch.cuda.synchronize(device)
        free_after, _ = torch.cuda.mem_get_info(device)
        return max(free_before - free_after, 0)
