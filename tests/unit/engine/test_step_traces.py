"""Traced requests: the engine notes each step a request was in (prefill chunks and decodes,
with the batch around it) and reports them with the request's next output; others get none."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel, load_model
from engine.outputs import GenerateRequest, RequestOutput, StepTrace
from engine.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


def _run(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def test_prefill_chunks_and_decodes_of_a_traced_request(tiny: LoadedModel) -> None:
    # 16 tokens a step: the 40-token prompt takes three chunks, the first two without output.
    engine = LLMEngine(tiny, EngineConfig(num_pages=32, max_num_batched_tokens=16, max_num_seqs=4))
    engine.add_request(GenerateRequest("traced", list(range(1, 41)), PARAMS, trace_steps=True))
    engine.add_request(GenerateRequest("plain", [5, 6, 7], PARAMS))
    outputs = _run(engine)
    assert all(out.steps is None for out in outputs["plain"])
    first, *rest = outputs["traced"]
    assert first.steps is not None and [s.kind for s in first.steps] == ["prefill"] * 3
    assert sum(s.num_tokens for s in first.steps) == 40
    decodes: list[StepTrace] = [s for out in rest for s in (out.steps or [])]
    assert [s.kind for s in decodes] == ["decode", "decode"] and len(rest) == 2
    every = [*first.steps, *decodes]
    assert all(s.start_ns <= s.end_ns for s in every)
    assert all(a.end_ns <= b.start_ns for a, b in itertools.pairwise(every))
    assert all(0 < s.num_tokens <= s.batch_tokens <= 16 for s in every)
    assert any(s.batch_size == 2 for s in every)  # the other request shared some steps
