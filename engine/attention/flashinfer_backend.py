"""Paged attention on CUDA with FlashInfer, over the shared page table of ``metadata.py``.

``build_plan_args`` turns a step's metadata into the kernels' plan arguments (pure, CPU-testable);
``FlashInferAttentionBackend`` plans once per step and runs once per layer. For decode steps
replayed from CUDA graphs (``engine/cuda_graphs.py``) it also keeps one decode wrapper per
graph's batch size in FlashInfer's CUDA-graph mode, over buffers whose addresses never change.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from types import ModuleType
from typing import Any, Protocol

import torch

from engine.attention.backend import AttentionBackend, BackendUnavailableError
from engine.attention.kernel_plan import TENSOR_CORE_GROUP, WrapperKind, wrapper_requests
from engine.attention.metadata import AttentionMetadata
from engine.config import PREFILL_KERNELS

WORKSPACE_BYTES = 128 * 1024 * 1024


class PagedWrapper(Protocol):
    """What the backend needs of a FlashInfer batch wrapper (or of a test double)."""

    def plan(self, *args: Any, **kwargs: Any) -> None: ...

    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class FixedTable:
    """The page table a CUDA-graph decode wrapper plans into: its kernels read these addresses
    on every replay, so ``plan`` copies each step's table into them."""

    kv_indptr: torch.Tensor  # [batch + 1] int32, device
    kv_indices: torch.Tensor  # [capacity] int32, device (shared by every batch size)
    kv_last_page_len: torch.Tensor  # [batch] int32, device


class WrapperFactory(Protocol):
    def __call__(
        self,
        kind: WrapperKind,
        workspace: torch.Tensor,
        use_tensor_cores: bool,
        kernel: str,
        fixed: FixedTable | None = None,
    ) -> PagedWrapper: ...


@dataclass(frozen=True, slots=True)
class PlanArgs:
    """One step's arguments for ``plan``; host tensors are fresh per step (see the backend)."""

    qo_indptr: torch.Tensor  # [num_seqs + 1] int32, host
    kv_indptr: torch.Tensor  # [num_seqs + 1] int32, host
    kv_indices: torch.Tensor  # [total_pages] int32, on the kernel device
    kv_last_page_len: torch.Tensor  # [num_seqs] int32, host, each in 1..page_size
    num_tokens: int
    page_size: int
    is_decode_only: bool
    max_page_id: int  # bounds of the step's page ids and slots, checked against each layer's pool
    max_slot: int


def _host_int32(values: list[int], pin_memory: bool) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, pin_memory=pin_memory)


def _check_tensor(name: str, t: torch.Tensor, dtype: torch.dtype, length: int) -> None:
    if t.dtype != dtype or t.dim() != 1 or t.shape[0] != length:
        raise ValueError(
            f"{name} must be 1-D {dtype} of length {length}, got {t.dtype} {tuple(t.shape)}"
        )


def _check_host_table(
    meta: AttentionMetadata, qo: list[int], kv: list[int], last: list[int]
) -> None:
    """Checks the metadata's own tensors when they live on the host (no device sync needed)."""
    for name, t, expected in (
        ("qo_indptr", meta.qo_indptr, qo),
        ("kv_indptr", meta.kv_indptr, kv),
    ):
        values = t.tolist()
        if values[0] != 0 or any(b < a for a, b in pairwise(values)):
            raise ValueError(f"{name} must start at 0 and be non-decreasing, got {values}")
        if values != expected:
            raise ValueError(f"{name} {values} disagrees with the host lengths ({expected})")
    lens = meta.kv_last_page_len.tolist()
    if any(not 1 <= n <= meta.page_size for n in lens):
        raise ValueError(f"kv_last_page_len must lie in 1..{meta.page_size}, got {lens}")
    if lens != last:
        raise ValueError(f"kv_last_page_len {lens} disagrees with kv_lens ({last})")


def build_plan_args(
    meta: AttentionMetadata,
    *,
    device: torch.device,
    num_pages: int | None = None,
    pin_memory: bool = False,
) -> PlanArgs:
    """Derive and check the plan arguments; raises ``ValueError`` naming the broken invariant.

    The indptrs and last-page lengths are rebuilt from the host lists ``qo_lens``/``kv_lens`` so
    planning never waits on the GPU; page ids and slots are bounds-checked, because an id outside
    the pool would make the kernel read or write out of bounds: from the metadata's host bounds
    when it has them (``build_attention_metadata`` on a GPU), else from the tensors (a sync).
    """
    page_size = meta.page_size
    if page_size < 1:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if meta.num_seqs == 0:
        raise ValueError("a step must hold at least one sequence")
    if len(meta.kv_lens) != meta.num_seqs:
        raise ValueError(f"{meta.num_seqs} qo_lens but {len(meta.kv_lens)} kv_lens")
    qo_indptr, kv_indptr, last_page_len = [0], [0], []
    for i, (qo_len, kv_len) in enumerate(zip(meta.qo_lens, meta.kv_lens, strict=True)):
        if qo_len < 1:
            raise ValueError(f"sequence {i} runs {qo_len} tokens; at least one is needed")
        if kv_len < qo_len:
            raise ValueError(f"sequence {i} has kv_len {kv_len} < qo_len {qo_len}")
        num_seq_pages = (kv_len + page_size - 1) // page_size
        qo_indptr.append(qo_indptr[-1] + qo_len)
        kv_indptr.append(kv_indptr[-1] + num_seq_pages)
        last_page_len.append(kv_len - (num_seq_pages - 1) * page_size)
    num_seqs, num_tokens = meta.num_seqs, qo_indptr[-1]
    _check_tensor("qo_indptr", meta.qo_indptr, torch.int32, num_seqs + 1)
    _check_tensor("kv_indptr", meta.kv_indptr, torch.int32, num_seqs + 1)
    _check_tensor("kv_last_page_len", meta.kv_last_page_len, torch.int32, num_seqs)
    _check_tensor("kv_indices", meta.kv_indices, torch.int32, kv_indptr[-1])
    _check_tensor("slot_mapping", meta.slot_mapping, torch.int64, num_tokens)
    if meta.qo_indptr.device.type == "cpu":
        _check_host_table(meta, qo_indptr, kv_indptr, last_page_len)
    if meta.host_bounds is not None:  # read from the lists the tensors were made of
        lo_page, hi_page, lo_slot, hi_slot = meta.host_bounds
    else:
        pages, slots = meta.kv_indices, meta.slot_mapping.to(meta.kv_indices.device)
        bounds = torch.stack([pages.min().long(), pages.max().long(), slots.min(), slots.max()])
        lo_page, hi_page, lo_slot, hi_slot = bounds.tolist()  # a sync when on CUDA
    pool = num_pages if num_pages is not None else hi_page + 1
    if lo_page < 0 or hi_page >= pool:
        raise ValueError(f"kv_indices span {lo_page}..{hi_page}, outside the pool 0..{pool - 1}")
    if lo_slot < 0 or hi_slot >= pool * page_size:
        raise ValueError(f"slot_mapping spans {lo_slot}..{hi_slot}, outside the pool's slots")
    return PlanArgs(
        qo_indptr=_host_int32(qo_indptr, pin_memory),
        kv_indptr=_host_int32(kv_indptr, pin_memory),
        kv_indices=meta.kv_indices.to(device),
        kv_last_page_len=_host_int32(last_page_len, pin_memory),
        num_tokens=num_tokens,
        page_size=page_size,
        is_decode_only=meta.is_decode_only,
        max_page_id=hi_page,
        max_slot=hi_slot,
    )


def load_flashinfer() -> ModuleType:
    """Import FlashInfer on first use; only the CUDA backend needs it.

    The error names the real cause: FlashInfer itself missing, or one of its own imports failing
    (a missing dependency such as ``pynvml`` or ``tvm_ffi``, or a broken install).
    """
    try:
        return importlib.import_module("flashinfer")
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == "flashinfer":
            cause = "which is not installed"
        else:
            cause = f"whose import failed ({type(exc).__name__}: {exc})"
        raise BackendUnavailableError(
            f"the CUDA attention backend needs FlashInfer, {cause}: "
            "pip install 'atrium[gpu]' (flashinfer-python==0.7.2.post1)"
        ) from exc


def flashinfer_wrapper(
    kind: WrapperKind,
    workspace: torch.Tensor,
    use_tensor_cores: bool,
    kernel: str,
    fixed: FixedTable | None = None,
) -> PagedWrapper:
    """A FlashInfer wrapper; ``kernel`` is the prefill backend (``PREFILL_KERNELS``). A decode
    wrapper given a ``fixed`` table runs in FlashInfer's CUDA-graph mode, for that batch size.

    The decode wrapper is pinned to FA2 (tensor-core or plain decode kernel): its ``auto`` may
    switch to cuDNN when cudnn-frontend happens to be installed, a kernel nobody tested here.
    """
    fi = load_flashinfer()
    if kind == "prefill":
        wrapper: PagedWrapper = fi.BatchPrefillWithPagedKVCacheWrapper(
            workspace, kv_layout="NHD", backend=kernel
        )
    elif fixed is None:
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            workspace, kv_layout="NHD", use_tensor_cores=use_tensor_cores, backend="fa2"
        )
    else:
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            workspace,
            kv_layout="NHD",
            use_cuda_graph=True,
            use_tensor_cores=use_tensor_cores,
            paged_kv_indptr_buffer=fixed.kv_indptr,
            paged_kv_indices_buffer=fixed.kv_indices,
            paged_kv_last_page_len_buffer=fixed.kv_last_page_len,
            backend="fa2",
        )
    return wrapper


@dataclass(slots=True)
class _Step:
    args: PlanArgs  # keeps this step's host tensors alive until the next plan
    wrapper: PagedWrapper
    k_rows: torch.Tensor  # [num_tokens] int64, device: each new token's K row in the flat pool
    v_rows: torch.Tensor  # [num_tokens] int64, device: k_rows + page_size


class FlashInferAttentionBackend(AttentionBackend):
    """One prefill wrapper serves mixed steps (a decode is a query of length 1); a decode wrapper
    serves steps without prefill. Both share one workspace, allocated once.

    K/V are written by a slot scatter (two ``index_copy_`` into the pool viewed as rows) rather
    than ``append_paged_kv_cache``: ``slot_mapping`` already names each token's slot, the scatter
    needs no extra per-step tensors, and it is plain torch, so CPU tests cover the real write path.

    Host buffers: FlashInfer's ``plan`` copies the indptrs to the GPU with ``non_blocking=True``.
    They are allocated fresh (pinned) every step and held until the next ``plan``, never refilled
    in place, so an in-flight copy cannot read the next step's values; torch's pinned allocator
    only recycles a block after the copies recorded on it have finished.

    Graph decodes (``fix_decode_sizes``, then ``plan_fixed`` each step): one CUDA-graph decode
    wrapper per batch size, all over one fixed page table, and each token's K/V rows written
    into fixed buffers too, so a graph captured over ``forward`` reads this step's values.
    """

    name = "flashinfer"

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        num_pages: int | None = None,
        workspace_bytes: int = WORKSPACE_BYTES,
        use_decode_kernel: bool = True,
        prefill_kernel: str = "auto",
        wrapper_factory: WrapperFactory = flashinfer_wrapper,
    ) -> None:
        if num_kv_heads < 1 or num_q_heads % num_kv_heads != 0:
            raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of {num_kv_heads}")
        if prefill_kernel not in PREFILL_KERNELS:
            raise ValueError(f"prefill_kernel {prefill_kernel!r} is not one of {PREFILL_KERNELS}")
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_pages = num_pages
        self._pin_memory = self.device.type == "cuda"
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        # Groups of 4+ query heads per KV head decode on tensor cores (FA2's prefill kernel);
        # smaller groups (the default model's 9/3) use the plain decode kernel. `atrium kernels
        # build` compiles the modules these wrappers load from the same requests.
        wrappers = [
            wrapper_factory(r.kind, self._workspace, r.use_tensor_cores, r.kernel)
            for r in wrapper_requests(num_q_heads, num_kv_heads, prefill_kernel, use_decode_kernel)
        ]
        self._prefill = wrappers[0]
        self._decode = wrappers[1] if use_decode_kernel else None
        self._tensor_cores = num_q_heads // num_kv_heads >= TENSOR_CORE_GROUP
        self._factory = wrapper_factory
        self._step: _Step | None = None
        self._fixed: dict[int, PagedWrapper] = {}  # graph decode wrappers, by batch size
        self._fixed_indices = torch.empty(0, dtype=torch.int32, device=self.device)
        self._fixed_rows = torch.empty(2, 0, dtype=torch.long, device=self.device)
        self._planned: torch.cuda.Event | None = None  # recorded behind the last plan's copies

    @property
    def fixed_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._fixed))

    def fix_decode_sizes(self, sizes: Sequence[int], max_pages: int) -> None:
        """Make one CUDA-graph decode wrapper per batch size in ``sizes``, over one fixed page
        table holding up to ``max_pages`` page ids; a step's table must fit it."""
        if self._decode is None:
            raise ValueError("graph decodes need the decode kernel (use_decode_kernel=True)")
        if not sizes or min(sizes) < 1 or max_pages < max(sizes):
            raise ValueError(f"bad graph decode sizes {list(sizes)} for {max_pages} pages")
        largest, device = max(sizes), self.device
        indptr = torch.zeros(largest + 1, dtype=torch.int32, device=device)
        last = torch.ones(largest, dtype=torch.int32, device=device)
        self._fixed_indices = torch.zeros(max_pages, dtype=torch.int32, device=device)
        self._fixed_rows = torch.zeros(2, largest, dtype=torch.long, device=device)
        self._fixed = {
            n: self._factory(
                "decode",
                self._workspace,
                self._tensor_cores,
                "fa2",
                FixedTable(indptr[: n + 1], self._fixed_indices, last[:n]),
            )
            for n in sorted(set(sizes))
        }

    def plan_fixed(self, meta: AttentionMetadata) -> None:
        """``plan`` for a decode-only step of one of the fixed batch sizes: the page table goes
        into the fixed buffers of that size's wrapper, and the K/V rows into fixed rows."""
        self._step = None
        wrapper = self._fixed.get(meta.num_seqs)
        if wrapper is None or not meta.is_decode_only:
            raise ValueError(
                f"no graph decode wrapper for {meta.num_seqs} rows "
                f"(sizes {self.fixed_sizes}, decode only: {meta.is_decode_only})"
            )
        if meta.page_size != self.page_size:
            raise ValueError(f"metadata page_size {meta.page_size} != backend {self.page_size}")
        args = build_plan_args(
            meta, device=self.device, num_pages=self.num_pages, pin_memory=self._pin_memory
        )
        if args.kv_indices.shape[0] > self._fixed_indices.shape[0]:
            raise ValueError(
                f"{args.kv_indices.shape[0]} pages exceed the fixed page table's "
                f"{self._fixed_indices.shape[0]}"
            )
        self._await_last_plan()
        wrapper.plan(
            args.kv_indptr, args.kv_indices, args.kv_last_page_len, self.num_q_heads,
            self.num_kv_heads, self.head_dim, self.page_size,
            q_data_type=self.dtype, kv_data_type=self.dtype,
        )  # fmt: skip
        self._mark_planned()
        slots = meta.slot_mapping.to(self.device)
        k_rows, v_rows = (
            self._fixed_rows[0, : args.num_tokens],
            self._fixed_rows[1, : args.num_tokens],
        )
        # The flat row of slot s's K is s + (s // P) * P (see ``plan``); V's is P further.
        torch.div(slots, self.page_size, rounding_mode="floor", out=k_rows)
        k_rows.mul_(self.page_size).add_(slots)
        torch.add(k_rows, self.page_size, out=v_rows)
        self._step = _Step(args, wrapper, k_rows, v_rows)

    def _await_last_plan(self) -> None:
        """A FlashInfer plan writes its schedule into its wrapper's pinned host buffer and copies
        it to the device without blocking; the next plan must not overwrite the buffer before
        that copy ran. With overlapped steps (``engine/overlap.py``) the host plans a step while
        the one before may not have started: wait until the device is past the last plan's
        copies, which it reaches as soon as the step before that one ends (already waited for),
        so at once in practice."""
        if self._planned is not None:
            self._planned.synchronize()  # type: ignore[no-untyped-call]
            self._planned = None

    def _mark_planned(self) -> None:
        if self.device.type == "cuda":
            self._planned = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._planned.record()

    def plan(self, meta: AttentionMetadata) -> None:
        # A plan that fails half-way must not leave the previous step's plan runnable: forward
        # would attend over the old page table with this step's tokens.
        self._step = None
        if meta.page_size != self.page_size:
            raise ValueError(f"metadata page_size {meta.page_size} != backend {self.page_size}")
        args = build_plan_args(
            meta, device=self.device, num_pages=self.num_pages, pin_memory=self._pin_memory
        )
        heads = (self.num_q_heads, self.num_kv_heads, self.head_dim, self.page_size)
        wrapper: PagedWrapper
        self._await_last_plan()
        if args.is_decode_only and self._decode is not None:
            wrapper = self._decode
            wrapper.plan(
                args.kv_indptr, args.kv_indices, args.kv_last_page_len, *heads,
                q_data_type=self.dtype, kv_data_type=self.dtype,
            )  # fmt: skip
        else:
            wrapper = self._prefill
            wrapper.plan(
                args.qo_indptr, args.kv_indptr, args.kv_indices, args.kv_last_page_len,
                num_qo_heads=heads[0], num_kv_heads=heads[1], head_dim_qk=heads[2],
                page_size=heads[3], causal=True, q_data_type=self.dtype, kv_data_type=self.dtype,
            )  # fmt: skip
        self._mark_planned()
        slots = meta.slot_mapping.to(self.device)
        # Flat row of slot s's K in kv_cache.view(-1, Hkv, D): page p owns rows [2pP, 2pP + 2P).
        k_rows = (slots // self.page_size) * (2 * self.page_size) + slots % self.page_size
        self._step = _Step(args, wrapper, k_rows, k_rows + self.page_size)

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_pages, 2, page_size, num_kv_heads, head_dim]
    ) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
        step = self._step
        if step is None:
            raise RuntimeError("plan(meta) must be called before forward")
        self._check_inputs(step.args, q, k, v, kv_cache)
        rows = kv_cache.view(-1, self.num_kv_heads, self.head_dim)  # [num_pages * 2 * P, Hkv, D]
        rows.index_copy_(0, step.k_rows, k)
        rows.index_copy_(0, step.v_rows, v)
        return step.wrapper.run(q, kv_cache)  # strided q is fine: the kernels read its strides

    def _check_inputs(
        self,
        args: PlanArgs,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
    ) -> None:
        n, hq, hkv, d, p = (
            args.num_tokens, self.num_q_heads, self.num_kv_heads, self.head_dim, self.page_size,
        )  # fmt: skip
        if q.shape != (n, hq, d) or k.shape != (n, hkv, d) or v.shape != (n, hkv, d):
            raise ValueError(
                f"expected q [{n}, {hq}, {d}] and k, v [{n}, {hkv}, {d}]; got "
                f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        if kv_cache.dim() != 5 or kv_cache.shape[1:] != (2, p, hkv, d):
            raise ValueError(
                f"kv_cache must be [num_pages, 2, {p}, {hkv}, {d}], got {kv_cache.shape}"
            )
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous")
        if {q.dtype, k.dtype, v.dtype, kv_cache.dtype} != {self.dtype}:
            raise ValueError(f"q, k, v and kv_cache must all be {self.dtype}")
        if args.max_page_id >= kv_cache.shape[0] or args.max_slot >= kv_cache.shape[0] * p:
            raise ValueError(f"page {args.max_page_id} is outside this layer's {kv_cache.shape[0]}")
