"""Decode steps on the CUDA graphs' static buffers, run eagerly on CPU: the padding, the buffers
and the fixed plan are everything a replay adds but the capture, and they must change nothing.

The engine runs the same requests (shared prefixes, so cache hits; batches that pad) once as
usual and once with every decode-only step staged, padded, in the static buffers: tokens and
every KV page of the pool must be identical in float32. Padding rows write only the scratch
page. The graph-mode FlashInfer wrappers are stood in for by reference wrappers that read the
fixed buffers alone, as a replay does.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch

from engine.attention.flashinfer_backend import FlashInferAttentionBackend
from engine.attention.metadata import SeqSlice
from engine.attention.torch_backend import TorchAttentionBackend
from engine.config import EngineConfig
from engine.cuda_graphs import (
    DecodeGraphs,
    DecodeRow,
    GraphStep,
    decode_rows,
    default_sizes,
    memory_estimate,
    padded_size,
)
from engine.kv_budget import FreeMemory, size_kv_pool
from engine.llm_engine import GraphMode, LLMEngine
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import LoadedModel, load_model
from engine.outputs import GenerateRequest
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq
from radix_cache.radix_prefix_cache import RadixPrefixCache
from tests.unit.engine.test_flashinfer_plan import (
    HKV,
    HQ,
    PAGE,
    D,
    Kernels,
    dense_attention,
    meta_for,
)

SIZES = (1, 2, 4, 8)
NUM_PAGES = 64


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


# --- sizes and settings -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_num_seqs", "expected"),
    [
        (1, (1,)),
        (3, (1, 2, 3)),
        (8, (1, 2, 4, 8)),
        (20, (1, 2, 4, 8, 16, 20)),
        (64, (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)),
    ],
)
def test_default_sizes_end_at_max_num_seqs(max_num_seqs: int, expected: tuple[int, ...]) -> None:
    assert default_sizes(max_num_seqs) == expected


def test_default_sizes_step_by_sixteen_past_256() -> None:
    sizes = default_sizes(300)
    assert sizes[-5:] == (248, 256, 272, 288, 300) and len(sizes) == 4 + 31 + 3
    assert all(b - a <= 16 for a, b in itertools.pairwise(sizes))


@pytest.mark.parametrize(("rows", "size"), [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, None)])
def test_a_step_pads_to_the_smallest_size_that_holds_it(rows: int, size: int | None) -> None:
    assert padded_size(SIZES, rows) == size


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ((), "batch sizes"),
        ((0, 2), "batch sizes"),
        ((2, 65), "batch sizes"),
        ((4, 2), "increasing"),
    ],
)
def test_config_refuses_bad_graph_sizes(sizes: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(max_num_seqs=64, cuda_graph_sizes=sizes)


def test_graphs_are_on_by_default_and_sizes_follow_max_num_seqs() -> None:
    config = EngineConfig()
    assert config.cuda_graphs and config.cuda_graph_sizes is None
    assert EngineConfig(max_num_seqs=8, cuda_graph_sizes=(1, 8)).cuda_graph_sizes == (1, 8)


def test_the_graphs_memory_comes_out_of_the_kv_budget(tiny: LoadedModel) -> None:
    config = EngineConfig(kv_cache_memory_fraction=0.5, max_num_seqs=4, page_size=4)
    free = FreeMemory(2**30, "cuda")
    plain = size_kv_pool(config, 4096, 10**6, "cuda", free)
    reserved = memory_estimate(tiny.config, default_sizes(4), torch.bfloat16, 4096)
    less = size_kv_pool(config, 4096, 10**6, "cuda", free, reserved)
    assert plain.num_pages - less.num_pages == -(-reserved // 4096)
    small = memory_estimate(tiny.config, (1, 2), torch.bfloat16, 4096)
    assert small < reserved  # more rows and more sizes, more memory


# --- which steps replay -------------------------------------------------------------------------


def _request(tokens: int, computed: int, pages: list[int], lora_slot: int = -1) -> Request:
    request = Request(
        request_id=f"r{random.random()}",
        prompt_token_ids=[(7 * i + 3) % 200 for i in range(tokens)],
        params=SamplingParams(max_tokens=4),
        tenant_id="t",
        namespace="t",
        owner="req:r",
        arrival_index=0,
    )
    request.num_computed_tokens = computed
    request.block_table = pages
    request.lora_slot = lora_slot
    return request


def test_only_plain_decode_steps_become_rows() -> None:
    decode = ScheduledSeq(_request(6, 5, [3, 4]), 1, True)
    rows = decode_rows([decode])
    assert rows == [DecodeRow(decode.request.all_token_ids[5], 5, [3, 4])]
    chunk = ScheduledSeq(_request(6, 0, [3, 4]), 6, True)
    silent = ScheduledSeq(_request(6, 5, [3, 4]), 1, False)  # a chunk that takes no token
    drafted = ScheduledSeq(_request(6, 5, [3, 4]), 3, True, (1, 2))
    adapter = ScheduledSeq(_request(6, 5, [3, 4], lora_slot=0), 1, True)
    for other in (chunk, silent, drafted, adapter):
        assert decode_rows([decode, other]) is None


def _graphs(model: LoadedModel, sizes: tuple[int, ...] = SIZES) -> DecodeGraphs:
    cfg = model.config
    caches = [
        torch.zeros(NUM_PAGES + 1, 2, PAGE, cfg.num_kv_heads, cfg.head_dim)
        for _ in range(cfg.num_layers)
    ]
    return DecodeGraphs(
        model.model, TorchAttentionBackend(), caches, sizes=sizes, page_size=PAGE,
        scratch_page=NUM_PAGES, max_pages_per_seq=8,
    )  # fmt: skip


def test_steps_past_the_largest_size_or_the_page_table_run_eagerly(tiny: LoadedModel) -> None:
    graphs = _graphs(tiny, (1, 2))
    decodes = [ScheduledSeq(_request(6, 5, [2 * i, 2 * i + 1]), 1, True) for i in range(3)]
    assert graphs.rows_for(decodes[:2]) is not None
    assert graphs.rows_for(decodes) is None  # 3 rows, graphs up to 2
    assert graphs.rows_for([]) is None
    long = ScheduledSeq(_request(60, 59, list(range(15))), 1, True)  # 15 pages, the table 16
    assert graphs.rows_for([long]) is not None
    assert graphs.rows_for([long, long]) is None


# --- the static buffers, on CPU ---------------------------------------------------------------


def test_padding_rows_write_the_scratch_page_alone(tiny: LoadedModel) -> None:
    graphs = _graphs(tiny)
    for cache in graphs.kv_caches:
        cache.fill_(7.0)
    requests = [_request(6, 5, [10, 11]), _request(3, 2, [20]), _request(9, 8, [30, 31, 32])]
    rows = graphs.rows_for([ScheduledSeq(r, 1, True) for r in requests])
    assert rows is not None
    step = graphs.stage(rows)
    assert (step.size, step.num_rows) == (4, 3)
    logits = graphs.run(step)
    assert logits.shape == (3, tiny.config.vocab_size)
    written = {(11, 1), (20, 2), (32, 0)}  # (page, offset) of each row's new token
    for cache in graphs.kv_caches:
        changed = (cache != 7.0).flatten(3).any(-1).any(1)  # [pages, offsets]
        touched = {(int(p), int(o)) for p, o in changed.nonzero().tolist()}
        assert touched == written | {(NUM_PAGES, 0)}


def test_staged_views_keep_their_addresses_from_step_to_step(tiny: LoadedModel) -> None:
    graphs = _graphs(tiny)

    def stage(n: int, offset: int) -> GraphStep:
        reqs = [_request(6 + offset, 5 + offset, [2 * i, 2 * i + 1, 40]) for i in range(n)]
        rows = graphs.rows_for([ScheduledSeq(r, 1, True) for r in reqs])
        assert rows is not None
        return graphs.stage(rows)

    first = stage(3, 0)
    assert first.positions.tolist() == [5, 5, 5, 0]  # the padding row at position 0
    assert first.input_ids[3] == 0 and first.meta.kv_lens == [6, 6, 6, 1]
    assert first.meta.kv_indices.tolist() == [0, 1, 2, 3, 4, 5, NUM_PAGES]
    second = stage(4, 2)  # pads to 4 too, with other tokens and tables
    for a, b in zip(
        (first.input_ids, first.positions, first.logits_indices, first.meta.slot_mapping),
        (second.input_ids, second.positions, second.logits_indices, second.meta.slot_mapping),
        strict=True,
    ):
        assert a.data_ptr() == b.data_ptr() and a.shape == b.shape
    assert first.positions.tolist() == [7, 7, 7, 7]  # the same memory, this step's values


def _run(model: LoadedModel, mode: GraphMode) -> tuple[dict[str, list[int]], LLMEngine, list]:
    config = EngineConfig(
        page_size=PAGE, num_pages=NUM_PAGES, max_num_batched_tokens=64, max_num_seqs=8,
        speculative_tokens=0, cuda_graph_sizes=SIZES,
    )  # fmt: skip
    engine = LLMEngine(model, config, prefix_cache_factory=RadixPrefixCache, decode_graphs=mode)
    steps: list[tuple[int, int]] = []
    graphs = engine.runner.graphs
    if graphs is not None:
        run = graphs.run

        def spy(step: GraphStep) -> torch.Tensor:
            steps.append((step.num_rows, step.size))
            return run(step)

        graphs.run = spy  # type: ignore[method-assign]
    prefix = [(13 * i) % 200 + 3 for i in range(9)]
    requests = [
        GenerateRequest(
            f"r{i}", prefix + [i + 1] * (i % 3 + 1),
            SamplingParams(max_tokens=6 + i, temperature=0.0, ignore_eos=True), tenant_id="t",
        )
        for i in range(7)
    ]  # fmt: skip
    for request in requests:
        engine.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for _ in range(200):
        if not engine.has_unfinished:
            break
        for output in engine.step():
            tokens[output.request_id] += output.token_ids
    assert not engine.has_unfinished
    return tokens, engine, steps


def test_padded_decode_steps_match_the_plain_engine_token_for_token(tiny: LoadedModel) -> None:
    plain_tokens, plain, _ = _run(tiny, "off")
    tokens, engine, steps = _run(tiny, "eager")
    assert tokens == plain_tokens
    assert engine.stats.num_cached_tokens > 0  # the shared prefix was matched
    padded = {rows for rows, size in steps if size > rows}
    assert padded >= {3, 5, 6, 7}  # 7 requests finishing one by one pad at 7, 6, 5 and 3
    for ours, theirs in zip(engine.runner.kv_caches, plain.runner.kv_caches, strict=True):
        assert torch.equal(ours[:NUM_PAGES], theirs)  # every page of the pool, bit for bit
    assert engine.runner.scratch_page == NUM_PAGES and plain.runner.scratch_page is None


def test_cpu_engines_stage_nothing_whatever_the_setting(tiny: LoadedModel) -> None:
    config = EngineConfig(page_size=PAGE, num_pages=NUM_PAGES, max_num_seqs=8)
    assert config.cuda_graphs
    engine = LLMEngine(tiny, config)
    assert engine.runner.graphs is None and engine.runner.scratch_page is None
    assert engine.runner.kv_caches[0].shape[0] == NUM_PAGES


def test_capture_without_a_fixed_planner_leaves_steps_eager(tiny: LoadedModel) -> None:
    config = EngineConfig(page_size=PAGE, num_pages=NUM_PAGES, max_num_seqs=8)
    engine = LLMEngine(tiny, config, decode_graphs="capture")  # the torch backend
    assert engine.runner.graphs is None
    with pytest.raises(ValueError, match="CUDA device"):
        _graphs(tiny).capture()


# --- FlashInfer's graph-mode wrappers, stood in for on CPU ----------------------------------


def test_fixed_plans_attend_from_the_fixed_buffers_alone() -> None:
    kernels = Kernels()
    backend = FlashInferAttentionBackend(
        HQ, HKV, D, PAGE, torch.float32, "cpu", num_pages=NUM_PAGES + 1, workspace_bytes=64,
        wrapper_factory=kernels,
    )  # fmt: skip
    backend.fix_decode_sizes(SIZES, 64)
    assert sorted(kernels.fixed) == list(SIZES) and backend.fixed_sizes == SIZES
    tables = [w.fixed for w in kernels.fixed.values() if w.fixed is not None]
    assert len({t.kv_indices.data_ptr() for t in tables}) == 1  # one page table for every size
    assert [t.kv_last_page_len.shape[0] for t in tables] == list(SIZES)
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(NUM_PAGES + 1, 2, PAGE, HKV, D, generator=gen)
    graphs = DecodeGraphs(  # its staging alone, over this backend
        _NoModel(), backend, [cache], sizes=SIZES, page_size=PAGE, scratch_page=NUM_PAGES,
        max_pages_per_seq=8,
    )  # fmt: skip
    for seed, n in enumerate((3, 5, 1)):
        rng = random.Random(seed)
        pages = rng.sample(range(NUM_PAGES), 3 * n)
        rows = [
            DecodeRow(0, rng.randint(0, 3 * PAGE - 1), pages[3 * i : 3 * i + 3]) for i in range(n)
        ]
        step = graphs.stage(rows)
        backend.plan_fixed(step.meta)
        wrapper = kernels.fixed[step.size]
        q = torch.randn(step.size, HQ, D, generator=gen)
        k, v = torch.randn(2, step.size, HKV, D, generator=gen)
        out = backend.forward(0, q, k, v, cache)
        for i, row in enumerate(rows):
            kv_pages = row.page_ids[: row.position // PAGE + 1]
            keys = cache[kv_pages, 0].reshape(-1, HKV, D)[: row.position + 1]
            values = cache[kv_pages, 1].reshape(-1, HKV, D)[: row.position + 1]
            assert torch.equal(keys[-1], k[i]) and torch.equal(values[-1], v[i])
            expected = dense_attention(q[i : i + 1], keys, values)
            torch.testing.assert_close(out[i : i + 1], expected, rtol=1e-5, atol=1e-5)
        if step.size > n:  # the last padding row's K went to the scratch page
            assert torch.equal(cache[NUM_PAGES, 0, 0], k[-1])
        assert wrapper.runs == 1 and len(wrapper.plans) == 1
        wrapper.runs, wrapper.plans = 0, []


def test_fixed_plans_refuse_sizes_without_a_wrapper() -> None:
    backend = FlashInferAttentionBackend(
        HQ, HKV, D, PAGE, torch.float32, "cpu", workspace_bytes=64, wrapper_factory=Kernels()
    )
    backend.fix_decode_sizes((2,), 8)
    with pytest.raises(ValueError, match="no graph decode wrapper for 1 rows"):
        backend.plan_fixed(meta_for([SeqSlice([0], 2, 1)]))
    with pytest.raises(ValueError, match="decode only: False"):
        backend.plan_fixed(meta_for([SeqSlice([0], 0, 2), SeqSlice([1], 2, 1)]))
    without = FlashInferAttentionBackend(
        HQ, HKV, D, PAGE, torch.float32, "cpu", workspace_bytes=64, use_decode_kernel=False,
        wrapper_factory=Kernels(),
    )  # fmt: skip
    with pytest.raises(ValueError, match="decode kernel"):
        without.fix_decode_sizes((1,), 8)


class _NoModel(LlamaForCausalLM):
    """DecodeGraphs' staging and planning need no model; a forward would be a mistake."""

    def __init__(self) -> None:
        torch.nn.Module.__init__(self)
        self.layers = torch.nn.ModuleList()

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the model is not run here")
