"""Prefill MFU and decode bandwidth of a random-weight ~1B Llama through the engine's own model
and attention backend; prints one JSON report. ``--smoke`` runs a tiny model on CPU.

Each decode batch is timed as an eager step, and as the engine's graph step (stage the rows in
the static buffers, plan, replay the CUDA graph; ``engine/cuda_graphs.py``). On a CPU, or with
a backend that cannot plan for graphs, the graph step runs the same buffers eagerly
(``graph_captured`` false). The graph step is timed twice more, feeding each step the ids the
one before chose, as the engine does: read back before the next step is staged (a synchronous
engine step), and left on the device, the next step staged and launched first and its inputs
copied from them (an overlapped step, ``engine/overlap.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import quiet_logging
from engine.attention.backend import AttentionBackend, allocate_kv_caches
from engine.attention.metadata import SeqSlice, build_attention_metadata
from engine.attention.registry import create_backend
from engine.cuda_graphs import DecodeGraphs, DecodeRow, FixedPlanner
from engine.device import dtype_name, resolve_device
from engine.model.config import ModelConfig
from engine.model.llama import LlamaForCausalLM
from engine.overlap import fill_inputs
from engine.transfers import Download

H200_PEAK_FLOPS = 989e12  # dense bf16 tensor-core peak, FLOP/s
H200_PEAK_BYTES = 4.8e12  # HBM3e bandwidth, B/s


@dataclass(frozen=True, slots=True)
class BenchShape:
    model: ModelConfig
    dtype: torch.dtype
    page_size: int
    prefill_seqs: int
    prefill_len: int
    decode_batches: tuple[int, ...]
    decode_context: int  # kv_len of every decode, its new token included
    warmup: int
    iters: int


FULL = BenchShape(
    model=ModelConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        max_position_embeddings=4096,
    ),
    dtype=torch.bfloat16,
    page_size=16,
    prefill_seqs=4,
    prefill_len=2048,  # 8192 tokens: the GPU step budget
    decode_batches=(1, 32, 128),
    decode_context=1024,
    warmup=3,
    iters=10,
)
SMOKE = BenchShape(
    model=ModelConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    ),
    dtype=torch.float32,
    page_size=4,
    prefill_seqs=2,
    prefill_len=16,
    decode_batches=(1, 2),
    decode_context=24,
    warmup=1,
    iters=2,
)


def random_model(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """Built on the meta device, then given N(0, 0.02) weights (norms 1) made on ``device``."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    gen = torch.Generator(device=device).manual_seed(0)
    state = {}
    for name, meta_param in model.state_dict().items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(meta_param.shape, dtype=dtype, device=device)
        else:
            t = torch.empty(meta_param.shape, dtype=dtype, device=device)
            state[name] = t.normal_(0.0, 0.02, generator=gen)
    model.load_weights(state)
    return model


def matmul_params(model: LlamaForCausalLM) -> int:
    """Weights every token multiplies through in the decoder layers (norms excluded)."""
    return sum(p.numel() for p in model.layers.parameters() if p.dim() == 2)


def seconds_per_call(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


def _pages(num_seqs: int, kv_len: int, page_size: int) -> list[list[int]]:
    per_seq = -(-kv_len // page_size)
    return [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)]


def bench_prefill(
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    caches: list[torch.Tensor],
    shape: BenchShape,
    device: torch.device,
) -> dict[str, Any]:
    c, n, length = shape.model, shape.prefill_seqs, shape.prefill_len
    seqs = [SeqSlice(p, 0, length) for p in _pages(n, length, shape.page_size)]
    meta = build_attention_metadata(seqs, shape.page_size, device)
    tokens = n * length
    input_ids = torch.randint(0, c.vocab_size, (tokens,), device=device)
    positions = torch.arange(length, device=device).repeat(n)
    logits_indices = (meta.qo_indptr[1:] - 1).long()
    secs = seconds_per_call(
        lambda: model(input_ids, positions, meta, backend, caches, logits_indices),
        device,
        shape.warmup,
        shape.iters,
    )
    # Causal attention: query i sees i + 1 keys; QK^T and PV cost 2 FLOP per multiply-add each.
    attn = c.num_layers * n * 4 * c.num_heads * c.head_dim * length * (length + 1) // 2
    flops = 2 * matmul_params(model) * tokens + 2 * c.vocab_size * c.hidden_size * n + attn
    return {
        "num_seqs": n,
        "seq_len": length,
        "tokens": tokens,
        "seconds": secs,
        "tok_per_s": tokens / secs,
        "tflops": flops / secs / 1e12,
        "mfu": flops / secs / H200_PEAK_FLOPS,
    }


def bench_decode(
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    caches: list[torch.Tensor],
    shape: BenchShape,
    device: torch.device,
    *,
    batch: int,
    graphs: DecodeGraphs | None = None,
) -> dict[str, Any]:
    c, ctx = shape.model, shape.decode_context
    seqs = [SeqSlice(p, ctx - 1, 1) for p in _pages(batch, ctx, shape.page_size)]
    meta = build_attention_metadata(seqs, shape.page_size, device)
    input_ids = torch.randint(0, c.vocab_size, (batch,), device=device)
    positions = torch.full((batch,), ctx - 1, device=device)
    logits_indices = torch.arange(batch, device=device)

    def step() -> torch.Tensor:  # plan, every layer, greedy pick: one decode step of the engine
        logits: torch.Tensor = model(input_ids, positions, meta, backend, caches, logits_indices)
        return logits.argmax(-1)

    secs = seconds_per_call(step, device, shape.warmup, shape.iters)
    elt = torch.finfo(shape.dtype).bits // 8
    weight_bytes = (matmul_params(model) + c.vocab_size * c.hidden_size) * elt
    kv_bytes = batch * ctx * c.num_layers * 2 * c.num_kv_heads * c.head_dim * elt
    report: dict[str, Any] = {
        "batch": batch,
        "context": ctx,
        "step_ms": secs * 1e3,
        "tok_per_s": batch / secs,
        "bytes_per_step": weight_bytes + kv_bytes,
        "gb_per_s": (weight_bytes + kv_bytes) / secs / 1e9,
        "bandwidth_util": (weight_bytes + kv_bytes) / secs / H200_PEAK_BYTES,
    }
    if graphs is not None:
        ids = input_ids.tolist()
        rows = [DecodeRow(ids[i], ctx - 1, seq.page_ids) for i, seq in enumerate(seqs)]

        def graph_step() -> torch.Tensor:  # stage, plan, replay, greedy pick
            assert graphs is not None
            return graphs.run(graphs.stage(rows)).argmax(-1)

        graph_secs = seconds_per_call(graph_step, device, shape.warmup, shape.iters)
        read_secs, overlap_secs = time_fed_graph_steps(graphs, rows, device, shape)
        report |= {
            "graph_step_ms": graph_secs * 1e3,
            "graph_tok_per_s": batch / graph_secs,
            "graph_bandwidth_util": (weight_bytes + kv_bytes) / graph_secs / H200_PEAK_BYTES,
            "graph_read_step_ms": read_secs * 1e3,
            "overlap_step_ms": overlap_secs * 1e3,
            "overlap_tok_per_s": batch / overlap_secs,
        }
    return report


def time_fed_graph_steps(
    graphs: DecodeGraphs, rows: list[DecodeRow], device: torch.device, shape: BenchShape
) -> tuple[float, float]:
    """Seconds per graph step fed the ids of the step before: read back to the host first (the
    synchronous engine), and left on the device while the next step is staged and launched,
    then read (the overlapped engine)."""
    ids = [r.token_id for r in rows]

    def read_step() -> None:  # stage the ids read back, replay, pick, read
        staged = [DecodeRow(i, r.position, r.page_ids) for i, r in zip(ids, rows, strict=True)]
        ids[:] = graphs.run(graphs.stage(staged)).argmax(-1).tolist()

    everyone = list(range(len(rows)))
    in_flight: list[tuple[torch.Tensor, Download]] = []  # the step before: its ids, their copy

    def overlap_step() -> None:  # stage, take the inputs from the device, replay, pick; then read
        step = graphs.stage(rows)
        if in_flight:
            fill_inputs(step.input_ids, everyone, everyone, in_flight[0][0])
        chosen = graphs.run(step).argmax(-1)
        if in_flight:
            _, download = in_flight.pop()
            download.wait()
        in_flight.append((chosen, Download(chosen)))

    read = seconds_per_call(read_step, device, shape.warmup, shape.iters)
    overlap = seconds_per_call(overlap_step, device, shape.warmup, shape.iters)
    return read, overlap


def run(
    shape: BenchShape, device: torch.device, backend_name: str | None, prefill_kernel: str = "auto"
) -> dict[str, Any]:
    c = shape.model
    model = random_model(c, shape.dtype, device)
    per_seq_pages = max(
        -(-shape.prefill_len // shape.page_size), -(-shape.decode_context // shape.page_size)
    )
    num_pages = per_seq_pages * max(shape.prefill_seqs, *shape.decode_batches)
    backend = create_backend(
        device,
        c,
        page_size=shape.page_size,
        dtype=shape.dtype,
        num_pages=num_pages + 1,  # the last: the graphs' scratch page
        name=backend_name,
        prefill_kernel=prefill_kernel,
    )
    caches = allocate_kv_caches(
        c.num_layers, num_pages + 1, shape.page_size, c.num_kv_heads, c.head_dim, shape.dtype,
        device,
    )  # fmt: skip
    graphs = DecodeGraphs(
        model, backend, caches, sizes=shape.decode_batches, page_size=shape.page_size,
        scratch_page=num_pages, max_pages_per_seq=per_seq_pages,
    )  # fmt: skip
    capture_s = None
    if device.type == "cuda" and isinstance(backend, FixedPlanner):
        start = time.perf_counter()
        graphs.capture()
        capture_s = time.perf_counter() - start
    elt = torch.finfo(shape.dtype).bits // 8
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "backend": backend.name,
        "prefill_kernel": prefill_kernel if backend.name == "flashinfer" else None,
        "dtype": dtype_name(shape.dtype),
        "torch": torch.__version__,
        "model": {
            "params": sum(p.numel() for p in model.parameters()),
            "weight_bytes": (matmul_params(model) + c.vocab_size * c.hidden_size) * elt,
            "hidden_size": c.hidden_size,
            "num_layers": c.num_layers,
            "num_heads": c.num_heads,
            "num_kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "vocab_size": c.vocab_size,
        },
        "peaks": {"flops": H200_PEAK_FLOPS, "bytes_per_s": H200_PEAK_BYTES},
        "graph_captured": bool(graphs.captured),
        "graph_capture_s": capture_s,
        "prefill": bench_prefill(model, backend, caches, shape, device),
        "decode": [
            bench_decode(model, backend, caches, shape, device, batch=b, graphs=graphs)
            for b in shape.decode_batches
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_bench", description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny model, seconds on CPU")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--backend", default=None, help="attention backend (default: device's)")
    parser.add_argument(
        "--prefill-kernel", default="auto", help="FlashInfer's prefill kernel: auto, fa2, fa3"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    quiet_logging()  # stdout carries the JSON alone
    device = resolve_device(args.device)
    report = run(SMOKE if args.smoke else FULL, device, args.backend, args.prefill_kernel)
    text = json.dumps(report, indent=2)
    print(text)
    out = args.out
    if out is None and os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / f"gpu_bench_{report['backend']}.json"
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
