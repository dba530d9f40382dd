"""The decode-step profile on a tiny random Llama: every part timed, shares whole, floors right."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from bench.decode_profile import (
    PartTimer,
    decode_floor,
    profile_batch,
    shared_prefix_prompts,
)
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model import llama, mlp
from engine.model.loader import LoadedModel, load_model
from engine.model.packed_linear import project
from radix_cache import RadixPrefixCache


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


def _engine(tiny: LoadedModel) -> LLMEngine:
    config = EngineConfig(num_pages=64, max_num_batched_tokens=128, speculative_tokens=0)
    return LLMEngine(tiny, config, prefix_cache_factory=RadixPrefixCache)


def test_groups_share_their_prefix_and_stay_in_the_vocabulary() -> None:
    prompts = shared_prefix_prompts(6, 2, 8, 3, seed=1, vocab=260)
    assert [len(p) for p in prompts] == [11] * 6
    assert prompts[0][:8] == prompts[2][:8] == prompts[4][:8] != prompts[1][:8]
    assert len({tuple(p[8:]) for p in prompts}) == 6
    assert all(0 <= t < 260 for p in prompts for t in p)


def test_profile_times_every_projection_and_restores_the_model(tiny: LoadedModel) -> None:
    engine = _engine(tiny)
    args = argparse.Namespace(groups=2, prefix_len=32, suffix_len=8, steps=2)
    peaks = {"gemm_gflops": 10.0, "read_gbs": 5.0}
    run = profile_batch(engine, args, 4, peaks)
    layers = tiny.config.num_layers
    calls = run["calls_per_step"]
    assert calls["projections"] == 4 * layers  # qkv, o, gate_up, down
    assert calls["lm_head"] == 1
    assert calls["attention"] == layers
    shares = run["step_share"]
    assert sum(shares.values()) == pytest.approx(1.0)
    assert 0 < shares["forward"] <= 1
    # The timed parts lie inside the forward of the steps that timed them.
    forward = run["timed_forward_share"]
    assert 0 < forward <= 1
    assert sum(run["forward_share"].values()) == pytest.approx(forward, rel=0.05)
    assert run["torch_ops_dispatched_per_step"] > layers
    # Every patched name is the original again; the engine still runs.
    assert vars(llama)["project"] is project and vars(mlp)["project"] is project
    assert "forward" not in vars(engine.runner.backend)
    assert not engine.has_unfinished
    timer = PartTimer(engine)
    with timer.installed():
        assert vars(llama)["project"] is not project
    assert vars(llama)["project"] is project


def test_the_floor_counts_weights_once_and_each_shared_prefix_once(tiny: LoadedModel) -> None:
    engine = _engine(tiny)
    config = tiny.config
    peaks = {"gemm_gflops": 1.0, "read_gbs": 1.0}  # 1e9 per second each
    floor = decode_floor(engine, batch=4, groups=2, prefix_len=16, private_len=8, peaks=peaks)
    model = engine.runner.model
    numel = model.output_weight.numel() + sum(
        p.numel() for name, p in model.named_parameters() if "proj" in name and "weight" in name
    )
    assert floor["gemm_gflop"] == pytest.approx(2 * 4 * numel / 1e9)
    # Compute (8 flops per weight) outweighs reading the float32 weights (4 bytes) here.
    assert floor["gemm_ms"] == pytest.approx(1e3 * 2 * 4 * numel / 1e9)
    kv_bytes = config.num_layers * (2 * 16 + 4 * 8) * 2 * config.num_kv_heads * config.head_dim * 4
    assert floor["kv_mb"] == pytest.approx(kv_bytes / 1e6)
    assert floor["floor_ms"] == pytest.approx(floor["gemm_ms"] + floor["attention_ms"])
