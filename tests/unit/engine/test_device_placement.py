"""Every tensor of a step is made on the engine's device, and a step reads the device once.

On a CPU-only machine a tensor on the wrong device goes unnoticed (everything is on the CPU), so
this test watches how tensors are made instead (``tests/support/step_audit.py``): while requests
are added and steps run, every tensor factory called without ``device=``, every read of a
tensor's values on the host (``tolist``, ``item``, ``bool``...) and every generator made without
a device, by the engine's device-generic step code. One engine runs every sampling path
together: greedy with n-gram drafts, unseeded and seeded sampling with top-k/top-p/min-p,
logprobs with alternatives, penalties, logit_bias and min_tokens, a JSON schema and a LoRA
adapter. tests/gpu/test_sampling_cuda.py runs the same on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.serve_model import write_adapter
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel, load_model
from radix_cache.radix_prefix_cache import RadixPrefixCache
from tests.support.step_audit import check_every_path_ran, every_path_requests, run_audited
from tests.support.tiny_llama import TINY_CONFIG


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


def test_a_step_makes_every_tensor_on_the_engine_device(tiny: LoadedModel, tmp_path: Path) -> None:
    adapter = write_adapter(tmp_path / "adapter", TINY_CONFIG, seed=3, rank=4)
    config = EngineConfig(
        num_pages=64, max_num_batched_tokens=256, max_num_seqs=16, max_loras=1,
        max_lora_rank=4, speculative_tokens=3, dtype="float32",
    )  # fmt: skip
    run = run_audited(
        lambda: LLMEngine(tiny, config, prefix_cache_factory=RadixPrefixCache),
        every_path_requests(adapter),
    )
    check_every_path_ran(run)
    assert run.audit.no_device == []
    assert run.generators_made == []
    # The chosen ids (with their logprobs) are the one read of the device per step; the CPU
    # sampler also reads whether a row had no finite logit, on the CPU only.
    reads = dict(run.audit.host_reads)
    assert 0 < reads.pop(("engine/logprobs.py", "gather")) <= run.num_steps
    assert set(reads) <= {("engine/sampler.py", "_sample_rows")}


def test_overlapped_steps_make_every_tensor_on_the_device_and_read_once(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """Forced on the CPU: greedy, unseeded, seeded and LoRA decodes stay in flight (the other
    paths never do), their ids read back once a step (``engine/transfers.py``)."""
    adapter = write_adapter(tmp_path / "adapter", TINY_CONFIG, seed=3, rank=4)
    config = EngineConfig(
        num_pages=64, max_num_batched_tokens=256, max_num_seqs=16, max_loras=1,
        max_lora_rank=4, speculative_tokens=0, dtype="float32",
    )  # fmt: skip
    requests = [
        r
        for r in every_path_requests(adapter)
        if r.request_id in ("greedy", "unseeded", "seeded", "lora")
    ]
    run = run_audited(
        lambda: LLMEngine(tiny, config, prefix_cache_factory=RadixPrefixCache, overlap=True),
        requests,
    )
    assert run.engine.stats.num_overlapped_steps > 0
    assert all(outs[-1].error is None and outs[-1].finished for outs in run.outputs.values())
    assert run.audit.no_device == []
    assert run.generators_made == []
    reads = dict(run.audit.host_reads)
    waits = reads.pop(("engine/transfers.py", "wait"))
    assert waits == run.engine.stats.num_overlapped_steps
    assert 0 < waits + reads.pop(("engine/logprobs.py", "gather")) <= run.num_steps
    assert set(reads) <= {("engine/sampler.py", "_sample_rows")}
