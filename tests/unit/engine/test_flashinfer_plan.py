"""The FlashInfer backend's own logic on CPU: plan arguments, their checks, and the call sequence.

A reference wrapper stands in for the kernel: it attends over the pages using only the arguments
the backend planned, so a wrong page table, slot scatter or plan call shows up as a wrong output.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from engine.attention.flashinfer_backend import (
    FixedTable,
    FlashInferAttentionBackend,
    PagedWrapper,
    build_plan_args,
)
from engine.attention.kernel_plan import WrapperKind
from engine.attention.metadata import AttentionMetadata, SeqSlice, build_attention_metadata

PAGE, NUM_PAGES, HQ, HKV, D = 4, 48, 4, 2, 8
CPU = torch.device("cpu")


def random_step(rng: random.Random, decode_only: bool = False) -> list[SeqSlice]:
    """Fresh prompts, chunks over cached prefixes and decodes, with ragged last pages."""
    free = list(range(NUM_PAGES))
    rng.shuffle(free)
    seqs = []
    for _ in range(rng.randint(1, 5)):
        kind = "decode" if decode_only else rng.choice(["fresh", "chunk", "decode"])
        computed = 0 if kind == "fresh" else rng.randint(1, 13)
        new = 1 if kind == "decode" else rng.randint(2, 9)
        num_pages = -(-(computed + new) // PAGE)
        seqs.append(SeqSlice([free.pop() for _ in range(num_pages)], computed, new))
    return seqs


Call = tuple[tuple[Any, ...], dict[str, Any]]


class ReferenceWrapper:
    """Records its constructor, plan and run calls; ``run`` attends over pages from the planned
    host arguments. ``calls`` feeds the signature check against the real FlashInfer. Given a
    ``fixed`` table it acts as FlashInfer's CUDA-graph mode: ``plan`` copies the table into the
    fixed buffers (its batch size must be theirs) and ``run`` reads the buffers alone, as a
    replayed graph would."""

    def __init__(
        self, kind: WrapperKind, constructor: Call, fixed: FixedTable | None = None
    ) -> None:
        self.kind = kind
        self.fixed = fixed
        self.calls: dict[str, list[Call]] = {"__init__": [constructor], "plan": [], "run": []}
        self.plans: list[Call] = []
        self.runs = 0
        self.fail_next_plan = False

    def plan(self, *args: Any, **kwargs: Any) -> None:
        self.calls["plan"].append((args, kwargs))
        if self.fail_next_plan:
            self.fail_next_plan = False
            raise RuntimeError("plan failed")
        self.plans.append((args, kwargs))
        if self.fixed is not None:
            indptr, indices, last = args[:3]
            assert last.shape == self.fixed.kv_last_page_len.shape  # the size is fixed
            self.fixed.kv_indptr.copy_(indptr)
            self.fixed.kv_last_page_len.copy_(last)
            self.fixed.kv_indices[: len(indices)].copy_(indices)

    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor) -> torch.Tensor:
        self.calls["run"].append(((q, paged_kv_cache), {}))
        self.runs += 1
        args, kwargs = self.plans[-1]
        if self.fixed is not None:
            kv_indptr, indices = self.fixed.kv_indptr, self.fixed.kv_indices
            last = self.fixed.kv_last_page_len
            qo = torch.arange(len(last) + 1, dtype=torch.int32)
        elif self.kind == "prefill":
            qo, kv_indptr, indices, last = args[:4]
            assert kwargs["causal"] is True
        else:
            kv_indptr, indices, last = args[:3]
            qo = torch.arange(len(last) + 1, dtype=torch.int32)
        out = torch.empty_like(q)
        for i in range(len(last)):
            pages = indices[kv_indptr[i] : kv_indptr[i + 1]].long()
            kv_len = (len(pages) - 1) * PAGE + int(last[i])
            k = paged_kv_cache[pages, 0].reshape(-1, HKV, D)[:kv_len]
            v = paged_kv_cache[pages, 1].reshape(-1, HKV, D)[:kv_len]
            out[qo[i] : qo[i + 1]] = dense_attention(q[qo[i] : qo[i + 1]], k, v)
        return out


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the last ``len(q)`` positions over ``k``/``v``, in float64."""
    qo_len, kv_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k64 = k.double().repeat_interleave(group, dim=1)
    v64 = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k64) / D**0.5
    allowed = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - qo_len, kv_len)[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v64).to(q.dtype)


class Kernels:
    """A wrapper factory recording the constructor call ``flashinfer_wrapper`` would make."""

    def __init__(self) -> None:
        self.made: dict[str, ReferenceWrapper] = {}
        self.fixed: dict[int, ReferenceWrapper] = {}  # CUDA-graph decode wrappers, by size

    def __call__(
        self,
        kind: WrapperKind,
        workspace: torch.Tensor,
        use_tensor_cores: bool,
        kernel: str,
        fixed: FixedTable | None = None,
    ) -> PagedWrapper:
        kwargs: dict[str, Any] = {"kv_layout": "NHD", "backend": kernel}
        if kind == "decode":
            kwargs["use_tensor_cores"] = use_tensor_cores
        if fixed is not None:
            kwargs |= {
                "use_cuda_graph": True,
                "paged_kv_indptr_buffer": fixed.kv_indptr,
                "paged_kv_indices_buffer": fixed.kv_indices,
                "paged_kv_last_page_len_buffer": fixed.kv_last_page_len,
            }
            wrapper = ReferenceWrapper(kind, ((workspace,), kwargs), fixed)
            self.fixed[len(fixed.kv_last_page_len)] = wrapper
            return wrapper
        self.made[kind] = ReferenceWrapper(kind, ((workspace,), kwargs))
        return self.made[kind]


def make_backend(**kwargs: Any) -> tuple[FlashInferAttentionBackend, Kernels]:
    kernels = Kernels()
    backend = FlashInferAttentionBackend(
        HQ,
        HKV,
        D,
        PAGE,
        torch.float32,
        "cpu",
        workspace_bytes=64,
        wrapper_factory=kernels,
        **kwargs,
    )
    return backend, kernels


def meta_for(seqs: list[SeqSlice]) -> AttentionMetadata:
    return build_attention_metadata(seqs, PAGE)


# --- plan arguments -------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_plan_args_reproduce_the_page_table(seed: int) -> None:
    seqs = random_step(random.Random(seed))
    meta = meta_for(seqs)
    args = build_plan_args(meta, device=CPU, num_pages=NUM_PAGES)
    for host in (args.qo_indptr, args.kv_indptr, args.kv_last_page_len):
        assert host.dtype == torch.int32 and host.device.type == "cpu"
    assert torch.equal(args.qo_indptr, meta.qo_indptr)
    assert torch.equal(args.kv_indptr, meta.kv_indptr)
    assert torch.equal(args.kv_last_page_len, meta.kv_last_page_len)
    assert args.kv_indices.dtype == torch.int32
    num_seq_pages = (args.kv_indptr[1:] - args.kv_indptr[:-1]).tolist()
    kv_lens = [
        (n - 1) * PAGE + last
        for n, last in zip(num_seq_pages, args.kv_last_page_len.tolist(), strict=True)
    ]
    assert kv_lens == [s.num_computed_tokens + s.num_new_tokens for s in seqs]
    assert args.num_tokens == sum(s.num_new_tokens for s in seqs)
    assert args.max_page_id == int(meta.kv_indices.max())
    assert args.max_slot == int(meta.slot_mapping.max())


def test_plan_args_flag_decode_only_steps() -> None:
    rng = random.Random(3)
    assert build_plan_args(meta_for(random_step(rng, decode_only=True)), device=CPU).is_decode_only
    mixed = [SeqSlice([0], 3, 1), SeqSlice([1, 2], 0, 5)]
    assert not build_plan_args(meta_for(mixed), device=CPU).is_decode_only


def test_plan_args_are_fresh_tensors_never_the_metadata_or_a_previous_step() -> None:
    meta = meta_for([SeqSlice([5, 6], 4, 3)])
    first = build_plan_args(meta, device=CPU)
    second = build_plan_args(meta, device=CPU)
    for a, b, m in zip(
        (first.qo_indptr, first.kv_indptr, first.kv_last_page_len),
        (second.qo_indptr, second.kv_indptr, second.kv_last_page_len),
        (meta.qo_indptr, meta.kv_indptr, meta.kv_last_page_len),
        strict=True,
    ):
        assert a.data_ptr() != b.data_ptr() and a.data_ptr() != m.data_ptr()


def _corrupt(meta: AttentionMetadata, **fields: Any) -> AttentionMetadata:
    values = {name: getattr(meta, name) for name in AttentionMetadata.__slots__}
    values.update(fields)
    return AttentionMetadata(**values)


GOOD = [SeqSlice([3, 9], 4, 2), SeqSlice([7], 2, 1)]
i32 = torch.int32


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kv_lens": [1, 3]}, "kv_len 1 < qo_len 2"),
        ({"qo_lens": [0, 1], "kv_lens": [6, 3]}, "at least one"),
        ({"qo_lens": [], "kv_lens": []}, "at least one sequence"),
        ({"kv_indptr": torch.tensor([0, 3, 2], dtype=i32)}, "non-decreasing"),
        ({"qo_indptr": torch.tensor([1, 2, 3], dtype=i32)}, "start at 0"),
        ({"kv_last_page_len": torch.tensor([2, 5], dtype=i32)}, "1..4"),
        ({"kv_last_page_len": torch.tensor([2, 0], dtype=i32)}, "1..4"),
        ({"kv_last_page_len": torch.tensor([1, 3], dtype=i32)}, "disagrees"),
        ({"kv_indices": torch.tensor([3, 9, 7], dtype=torch.int64)}, "kv_indices must be"),
        ({"kv_indices": torch.tensor([3, 9], dtype=i32)}, "kv_indices must be"),
        ({"kv_indices": torch.tensor([3, 99, 7], dtype=i32)}, "outside the pool"),
        ({"kv_indices": torch.tensor([3, -1, 7], dtype=i32)}, "outside the pool"),
        ({"slot_mapping": torch.tensor([36, 37, 9999])}, "slot_mapping spans"),
        ({"slot_mapping": torch.tensor([36, 37])}, "slot_mapping must be"),
        ({"page_size": 0}, "page_size must be positive"),
    ],
)
def test_plan_args_reject_broken_metadata(fields: dict[str, Any], message: str) -> None:
    meta = _corrupt(meta_for(GOOD), **fields)
    with pytest.raises(ValueError, match=message):
        build_plan_args(meta, device=CPU, num_pages=16)


# --- the backend's call sequence ------------------------------------------------------------


@dataclass
class Layer:
    q: torch.Tensor  # [num_tokens, HQ, D]
    k: torch.Tensor  # [num_tokens, HKV, D] this step's new keys
    v: torch.Tensor
    cache: torch.Tensor  # holds the cached prefixes; 7.0 everywhere else
    cache_after: torch.Tensor  # what the cache must hold after the step
    expected: torch.Tensor  # [num_tokens, HQ, D] dense causal attention


def make_layer(seqs: list[SeqSlice], gen: torch.Generator) -> Layer:
    cache = torch.full((NUM_PAGES, 2, PAGE, HKV, D), 7.0)
    after = cache.clone()
    qs, ks, vs, outs = [], [], [], []
    for s in seqs:
        kv_len = s.num_computed_tokens + s.num_new_tokens
        k, v = torch.randn(2, kv_len, HKV, D, generator=gen)
        q = torch.randn(s.num_new_tokens, HQ, D, generator=gen)
        for pos in range(kv_len):
            page, off = s.page_ids[pos // PAGE], pos % PAGE
            after[page, 0, off], after[page, 1, off] = k[pos], v[pos]
            if pos < s.num_computed_tokens:
                cache[page, 0, off], cache[page, 1, off] = k[pos], v[pos]
        qs.append(q)
        ks.append(k[s.num_computed_tokens :])
        vs.append(v[s.num_computed_tokens :])
        outs.append(dense_attention(q, k, v))
    return Layer(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, after, torch.cat(outs))


def run_step(
    backend: FlashInferAttentionBackend, seqs: list[SeqSlice], num_layers: int, seed: int = 0
) -> list[Layer]:
    gen = torch.Generator().manual_seed(seed)
    layers = [make_layer(seqs, gen) for _ in range(num_layers)]
    backend.plan(meta_for(seqs))
    for i, layer in enumerate(layers):
        out = backend.forward(i, layer.q, layer.k, layer.v, layer.cache)
        torch.testing.assert_close(out, layer.expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(layer.cache, layer.cache_after)  # new K/V in their slots, nothing else
    return layers


@pytest.mark.parametrize("seed", range(6))
def test_mixed_step_writes_slots_and_matches_dense_attention(seed: int) -> None:
    backend, _ = make_backend()
    run_step(backend, random_step(random.Random(seed)), num_layers=2, seed=seed)


def test_a_step_plans_once_and_runs_once_per_layer() -> None:
    backend, kernels = make_backend()
    run_step(backend, [SeqSlice([4, 5, 6], 5, 4), SeqSlice([8, 9], 6, 1)], num_layers=3)
    prefill, decode = kernels.made["prefill"], kernels.made["decode"]
    assert (len(prefill.plans), prefill.runs) == (1, 3)
    assert (len(decode.plans), decode.runs) == (0, 0)
    args, kwargs = prefill.plans[0]
    assert kwargs == {
        "num_qo_heads": HQ,
        "num_kv_heads": HKV,
        "head_dim_qk": D,
        "page_size": PAGE,
        "causal": True,
        "q_data_type": torch.float32,
        "kv_data_type": torch.float32,
    }
    assert args[0].tolist() == [0, 4, 5] and args[1].tolist() == [0, 3, 5]
    assert args[2].tolist() == [4, 5, 6, 8, 9] and args[3].tolist() == [1, 3]


def test_decode_only_steps_use_the_decode_wrapper_unless_disabled() -> None:
    decodes = random_step(random.Random(11), decode_only=True)
    backend, kernels = make_backend()
    run_step(backend, decodes, num_layers=2)
    assert (len(kernels.made["decode"].plans), kernels.made["decode"].runs) == (1, 2)
    assert kernels.made["prefill"].plans == []
    args, kwargs = kernels.made["decode"].plans[0]
    assert args[3:] == (HQ, HKV, D, PAGE) and kwargs["q_data_type"] == torch.float32

    backend, kernels = make_backend(use_decode_kernel=False)
    run_step(backend, decodes, num_layers=2)
    assert "decode" not in kernels.made and kernels.made["prefill"].runs == 2


def test_each_step_plans_with_its_own_host_buffers() -> None:
    backend, kernels = make_backend()
    run_step(backend, [SeqSlice([1, 2], 0, 6)], num_layers=1)
    run_step(backend, [SeqSlice([1, 2], 6, 1), SeqSlice([3], 0, 2)], num_layers=1)
    (first, _), (second, _) = kernels.made["prefill"].plans
    assert first[0].tolist() == [0, 6] and first[3].tolist() == [2]  # untouched by step two
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(first, second, strict=True))


def test_forward_needs_a_plan_and_matching_inputs() -> None:
    backend, _ = make_backend()
    layer = make_layer([SeqSlice([0, 1], 0, 5)], torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="plan"):
        backend.forward(0, layer.q, layer.k, layer.v, layer.cache)
    backend.plan(meta_for([SeqSlice([0, 1], 0, 5)]))
    with pytest.raises(ValueError, match="expected q"):
        backend.forward(0, layer.q[:4], layer.k[:4], layer.v[:4], layer.cache)
    with pytest.raises(ValueError, match="float32"):
        backend.forward(0, layer.q.double(), layer.k, layer.v, layer.cache)
    with pytest.raises(ValueError, match="kv_cache must be"):
        backend.forward(0, layer.q, layer.k, layer.v, layer.cache[:, :, :2])
    with pytest.raises(ValueError, match="outside this layer"):
        backend.forward(0, layer.q, layer.k, layer.v, layer.cache[:1].contiguous())


def test_a_failed_plan_leaves_no_plan_to_run() -> None:
    backend, kernels = make_backend()
    first = [SeqSlice([0, 1], 0, 5)]
    run_step(backend, first, num_layers=1)
    kernels.made["prefill"].fail_next_plan = True
    with pytest.raises(RuntimeError, match="plan failed"):
        backend.plan(meta_for([SeqSlice([2], 0, 3)]))
    layer = make_layer(first, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="plan"):
        backend.forward(0, layer.q, layer.k, layer.v, layer.cache)
    run_step(backend, [SeqSlice([2], 0, 3)], num_layers=1)  # the next good plan runs again


def test_a_strided_query_reaches_the_kernel_without_a_copy() -> None:
    backend, kernels = make_backend()
    seqs = [SeqSlice([0, 1], 2, 4)]
    layer = make_layer(seqs, torch.Generator().manual_seed(1))
    fused = torch.cat([layer.q, torch.zeros_like(layer.q)], dim=-1)  # [n, HQ, 2D]
    q = fused[..., :D]  # a view with a row stride of 2D, as a split of a fused projection gives
    assert not q.is_contiguous()
    backend.plan(meta_for(seqs))
    out = backend.forward(0, q, layer.k, layer.v, layer.cache)
    torch.testing.assert_close(out, layer.expected, rtol=1e-5, atol=1e-5)
    (ran_q, _), _ = kernels.made["prefill"].calls["run"][0]
    assert ran_q.data_ptr() == fused.data_ptr()


def test_prefill_kernel_choice_reaches_the_prefill_wrapper_only() -> None:
    _, kernels = make_backend(prefill_kernel="fa2")
    assert kernels.made["prefill"].calls["__init__"][0][1]["backend"] == "fa2"
    assert kernels.made["decode"].calls["__init__"][0][1]["backend"] == "fa2"
    with pytest.raises(ValueError, match="prefill_kernel"):
        make_backend(prefill_kernel="fa4")


def test_backend_rejects_other_page_sizes_and_head_counts() -> None:
    backend, _ = make_backend()
    with pytest.raises(ValueError, match="page_size"):
        backend.plan(build_attention_metadata([SeqSlice([0], 0, 3)], PAGE * 2))
    with pytest.raises(ValueError, match="multiple"):
        FlashInferAttentionBackend(6, 4, D, PAGE, torch.float32, "cpu", wrapper_factory=Kernels())


def test_plan_args_of_device_metadata_check_bounds_without_reading_the_device() -> None:
    """Metadata made for an accelerator carries its page and slot bounds from the host lists;
    planning reads those, never the tensors (here on ``meta``, where any read would raise)."""
    seqs = [SeqSlice([7, 2], 5, 3), SeqSlice([40], 0, 1)]
    meta = build_attention_metadata(seqs, PAGE, "meta")
    assert meta.host_bounds == (2, 40, 9, 160)  # positions 5..7 in page 2, 0 in page 40
    assert build_attention_metadata(seqs, PAGE, CPU).host_bounds is None
    args = build_plan_args(meta, device=torch.device("meta"), num_pages=NUM_PAGES)
    assert (args.max_page_id, args.max_slot, args.num_tokens) == (40, 160, 4)
    assert args.qo_indptr.tolist() == [0, 3, 4] and args.kv_indices.device.type == "meta"
    with pytest.raises(ValueError, match="outside the pool"):
        build_plan_args(meta, device=torch.device("meta"), num_pages=40)
