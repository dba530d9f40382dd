"""Penalties, logit_bias and min_tokens: batched rows equal a row-by-row reference, and the engine
applies them (and holds an n > 1 sibling until the shared prompt is computed)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.logits_processing import RowState, TokenHistory, process_logits
from engine.model.loader import LoadedModel, load_model
from engine.outputs import GenerateRequest, RequestOutput
from engine.sampling_params import SamplingParams
from radix_cache.radix_prefix_cache import RadixPrefixCache
from tests.support.greedy import run_all

VOCAB = 50
DEVICE = torch.device("cpu")


def reference(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """One row, token by token, straight from the definitions."""
    row = logits.clone()
    for token in set(prompt) | set(output):
        if params.repetition_penalty != 1.0:
            value = row[token]
            penalty = params.repetition_penalty
            row[token] = value / penalty if value > 0 else value * penalty
    for token in set(output):
        row[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    for token, bias in params.logit_bias:
        row[token] += bias
    if len(output) < params.min_tokens:
        for token in (7, *params.stop_token_ids):
            row[token] = float("-inf")
    return row


CASES = [
    SamplingParams(),
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=-0.7, presence_penalty=0.3),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(logit_bias=((3, 5.0), (4, -100.0))),
    SamplingParams(min_tokens=10, stop_token_ids=(9,)),
    SamplingParams(repetition_penalty=0.8, frequency_penalty=2.0, logit_bias=((1, 1.0),)),
]


def test_batched_rows_equal_the_row_by_row_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(len(CASES), VOCAB, generator=generator)
    prompts = [[(i * 5 + j) % VOCAB for j in range(6)] for i in range(len(CASES))]
    outputs = [[(i + 3 * j) % 11 for j in range(2 + i)] for i in range(len(CASES))]
    rows = []
    for params, prompt, output in zip(CASES, prompts, outputs, strict=True):
        history = None
        if params.processes_logits:
            history = TokenHistory.of(params, prompt, (7,), VOCAB, DEVICE)
            for token in output:
                history.append(token)
        rows.append(RowState(params, history, len(output)))
    expected = torch.stack(
        [reference(logits[i], CASES[i], prompts[i], outputs[i]) for i in range(len(CASES))]
    )
    got = process_logits(logits.clone(), rows)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = torch.isfinite(expected)
    assert torch.allclose(got[finite], expected[finite], atol=1e-5)
    assert torch.equal(got[0], logits[0])  # a row that asks for nothing is untouched


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (SamplingParams(frequency_penalty=float("nan")), "frequency_penalty"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(logit_bias=((1, 101.0),)), "logit_bias"),
        (SamplingParams(logit_bias=((-1, 1.0),)), "logit_bias"),
        (SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"),
        (SamplingParams(logprobs=21), "logprobs"),
        (SamplingParams(stop_token_ids=tuple(range(257))), "stop_token_ids"),
    ],
)
def test_out_of_range_values_name_their_parameter(params: SamplingParams, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        params.validate()
    assert info.value.param == param


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


def make_engine(tiny: LoadedModel, prefix_cache: bool = False) -> LLMEngine:
    config = EngineConfig(num_pages=48, max_num_batched_tokens=64, max_num_seqs=8)
    return LLMEngine(tiny, config, prefix_cache_factory=RadixPrefixCache if prefix_cache else None)


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def generate(engine: LLMEngine, params: SamplingParams, prompt: list[int]) -> list[int]:
    engine.add_request(GenerateRequest("r", prompt, params))
    return tokens(run_all(engine)["r"])


def test_engine_applies_bias_and_penalties(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    prompt = list(range(20, 40))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = generate(engine, greedy, prompt)
    forced = generate(engine, replace(greedy, logit_bias=((77, 100.0),)), prompt)
    assert forced == [77] * 12
    assert len(set(plain)) < 12  # the tiny random model repeats itself...
    penalised = replace(greedy, presence_penalty=2.0, frequency_penalty=2.0)
    spread = generate(engine, penalised, prompt)
    assert len(set(spread)) > len(set(plain))  # ...and stops once repeats are penalised
    assert engine.cache.pool.num_free_pages == engine.num_pages


def test_min_tokens_holds_off_stop_tokens(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    prompt = list(range(20, 40))
    first = generate(engine, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), prompt)
    stop_at_first = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(first[0],))
    assert generate(engine, stop_at_first, prompt) == [first[0]]
    held = generate(engine, replace(stop_at_first, min_tokens=5), prompt)
    assert len(held) >= 5 and first[0] not in held[:5]


def test_sibling_waits_and_reuses_the_prompt_pages(tiny: LoadedModel) -> None:
    engine = make_engine(tiny, prefix_cache=True)
    prompt = list(range(100, 150))  # three full pages and a bit
    params = SamplingParams(max_tokens=4, temperature=0.8, seed=1)
    engine.add_request(GenerateRequest("n0", prompt, params))
    for i in (1, 2):
        sibling = replace(params, seed=1 + i)
        engine.add_request(GenerateRequest(f"n{i}", prompt, sibling, prefill_after="n0"))
    outputs = run_all(engine)
    assert outputs["n0"][-1].num_cached_tokens == 0
    assert [outputs[f"n{i}"][-1].num_cached_tokens for i in (1, 2)] == [48, 48]
    assert engine.stats.num_prefill_tokens == 50 + 2 * 2  # the prompt once, then 2 tokens each
    # Fair share sees the real work: 54 prompt tokens computed, 96 reused (0.1 each) and 3 decode
    # steps per choice (2 each; the first token comes with the prefill).
    assert engine.scheduler.policy.service("default") == pytest.approx(54 + 0.1 * 96 + 2 * 9)
    assert len({tuple(tokens(outputs[f"n{i}"])) for i in range(3)}) > 1


def test_abort_of_a_held_sibling(tiny: LoadedModel) -> None:
    engine = make_engine(tiny, prefix_cache=True)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    engine.add_request(GenerateRequest("a", list(range(60)), params))
    engine.add_request(GenerateRequest("b", list(range(60)), params, prefill_after="a"))
    assert engine.abort("b")
    outputs = run_all(engine)
    assert outputs["b"][-1].finish_reason == "abort"
    assert outputs["a"][-1].finished
    assert not engine.has_unfinished
