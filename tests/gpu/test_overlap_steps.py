"""Overlapped decode steps on CUDA (engine/overlap.py): the host schedules and prepares a step
while the GPU runs the one before, replayed from CUDA graphs, in bfloat16 on FlashInfer.

Where every request ends by max_tokens (and nothing is preempted), the overlapped engine runs
the very steps of the synchronous one, so greedy and seeded tokens must be identical. With stop
tokens, an abort mid-stream and a pool that preempts, a request that a stop ended has one more
token computed (then dropped), so the batches differ from the synchronous run's and bfloat16
may round a near-tie the other way: there every request must end once, by a reason its tokens
explain, and every KV page must come back. tests/unit/engine/test_overlap_steps.py holds the
mixed workload to identical outputs on the CPU, in float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import pytest
import torch

from tests.gpu.test_sampling_cuda import ENGINE_MODEL

if TYPE_CHECKING:  # imported in the tests: tests/gpu collects with torch and FlashInfer alone
    from engine.llm_engine import LLMEngine
    from engine.model.loader import LoadedModel
    from engine.outputs import GenerateRequest

pytestmark = pytest.mark.gpu

STOP_IDS = tuple(range(3, 250, 6))


class Run(NamedTuple):
    tokens: dict[str, list[int]]
    reasons: dict[str, str]
    engine: LLMEngine


@pytest.fixture
def loaded(tmp_path: Path) -> LoadedModel:
    """The model of test_sampling_cuda's engine, in bfloat16 on the GPU (after the autouse skips:
    its imports need transformers)."""
    from bench.serve_model import write_model
    from engine.model.loader import load_model
    from tests.support.tiny_llama import byte_level_tokenizer

    byte_level_tokenizer().save_pretrained(str(tmp_path / "tokenizer"))
    model_dir = write_model(tmp_path / "model", tmp_path / "tokenizer", ENGINE_MODEL, seed=1)
    return load_model(str(model_dir), dtype=torch.bfloat16, device="cuda")


def _requests(early_ends: bool) -> list[tuple[int, GenerateRequest]]:
    """(the step it arrives before, the request): greedy and seeded, half on a shared prefix;
    with ``early_ends`` a third stop at any of ``STOP_IDS`` too."""
    from engine.outputs import GenerateRequest
    from engine.sampling_params import SamplingParams

    shared = [(13 * i) % 250 + 3 for i in range(40)]
    out = []
    for i in range(24):
        tail = [(7 * i + 5 * j) % 250 + 3 for j in range(3 + i % 9)]
        seeded = i % 2 == 1
        params = SamplingParams(
            max_tokens=8 + (5 * i) % 23,
            temperature=0.9 if seeded else 0.0,
            seed=1000 + i if seeded else None,
            stop_token_ids=STOP_IDS if early_ends and i % 3 == 0 else (),
            ignore_eos=True,
        )
        prompt = [*shared, *tail] if i % 2 == 0 else tail
        out.append((5 * (i // 8), GenerateRequest(f"r{i}", prompt, params, tenant_id="ab"[i % 2])))
    return out


def _run(loaded: LoadedModel, overlap: bool, num_pages: int, early_ends: bool, kernel: str) -> Run:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from radix_cache.radix_prefix_cache import RadixPrefixCache

    config = EngineConfig(
        num_pages=num_pages, max_num_batched_tokens=256, max_num_seqs=8, speculative_tokens=0,
        device="cuda", prefill_kernel=kernel,
    )  # fmt: skip
    engine = LLMEngine(loaded, config, prefix_cache_factory=RadixPrefixCache, overlap=overlap)
    assert engine.runner.graphs is not None and engine.runner.graphs.captured
    arrivals = _requests(early_ends)
    tokens: dict[str, list[int]] = {r.request_id: [] for _, r in arrivals}
    reasons: dict[str, str] = {}
    steps = 0
    while arrivals or engine.has_unfinished:
        while arrivals and arrivals[0][0] <= steps:
            engine.add_request(arrivals.pop(0)[1])
        for output in engine.step():
            assert output.request_id not in reasons, "an output after the request finished"
            assert output.error is None, output.error
            tokens[output.request_id] += output.token_ids
            if output.finished:
                reasons[output.request_id] = output.finish_reason or ""
        if early_ends and "r2" not in reasons and len(tokens["r2"]) >= 4:
            assert engine.abort("r2")
        steps += 1
        assert steps < 2_000
    pool = engine.cache.pool
    pool.check_integrity()
    engine.cache.check_integrity()
    assert all(not pool.owner(page).startswith("req:") for page in range(pool.num_pages))
    assert engine.cache.num_available_pages == pool.num_pages
    return Run(tokens, reasons, engine)


def test_overlapped_steps_are_the_synchronous_steps_on_cuda(
    loaded: LoadedModel, prefill_kernel: str
) -> None:
    plain = _run(loaded, False, 256, early_ends=False, kernel=prefill_kernel)
    overlapped = _run(loaded, True, 256, early_ends=False, kernel=prefill_kernel)
    assert overlapped.tokens == plain.tokens
    assert overlapped.reasons == plain.reasons == dict.fromkeys(plain.tokens, "length")
    stats = overlapped.engine.stats
    assert plain.engine.stats.num_overlapped_steps == 0
    assert stats.num_overlapped_steps > stats.num_steps // 3
    assert stats.num_cached_tokens > 0 and stats.num_preemptions == 0


def test_overlapped_steps_end_every_request_once_and_free_every_page_on_cuda(
    loaded: LoadedModel, prefill_kernel: str
) -> None:
    from engine.sampling_params import SamplingParams

    run = _run(loaded, True, 12, early_ends=True, kernel=prefill_kernel)
    params: dict[str, SamplingParams] = {r.request_id: r.params for _, r in _requests(True)}
    assert set(run.reasons) == set(params)
    assert set(run.reasons.values()) == {"stop", "length", "abort"}
    for request_id, reason in run.reasons.items():
        tokens, max_tokens = run.tokens[request_id], params[request_id].max_tokens
        if reason == "length":
            assert len(tokens) == max_tokens, request_id
        elif reason == "stop":
            assert tokens[-1] in STOP_IDS and len(tokens) <= max_tokens, request_id
            assert not set(tokens[:-1]) & set(STOP_IDS), request_id
        else:
            assert request_id == "r2" and len(tokens) in (4, 5)
    stats = run.engine.stats
    assert stats.num_overlapped_steps > 0 and stats.num_preemptions > 0
