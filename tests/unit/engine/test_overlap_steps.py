"""Overlapped decode steps (engine/overlap.py), forced on the CPU: the same outputs as steps
read at once, and every page back.

The tiny Llama in float32 runs one mixed workload twice, overlap off and on: greedy and seeded
sampled requests of different lengths, stop tokens and stop strings, max_tokens, an abort
mid-stream, shared prefixes (cache hits), and a pool small enough to preempt. Token ids, text
and finish reasons must be identical, steps must really have overlapped, and every KV page must
be back in the pool. The same again with decode steps staged in the CUDA graphs' static buffers,
run eagerly (``decode_graphs="eager"``). tests/gpu/test_overlap_steps.py checks it on CUDA.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import GraphMode, LLMEngine
from engine.model.loader import LoadedModel, load_model
from engine.outputs import GenerateRequest
from engine.overlap import deferrable, fill_inputs, pending_inputs
from engine.request import PLACEHOLDER_TOKEN, Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, SchedulerOutput
from radix_cache.radix_prefix_cache import RadixPrefixCache

ABORTED = "r4"  # greedy, no stop: aborted once it has three tokens out
ABORT_AFTER = 3


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


def workload() -> list[tuple[int, GenerateRequest]]:
    """(the step it arrives before, the request): 32 requests in four waves."""
    rng = random.Random(0)
    shared = [rng.randrange(3, 250) for _ in range(10)]
    stop_ids = tuple(range(3, 250, 6))  # about one token in six
    requests = []
    for i in range(32):
        tail = [rng.randrange(3, 250) for _ in range(rng.randint(1, 14))]
        prompt = [*shared, *tail] if i % 2 == 0 else [*tail, i + 3]
        seeded = i % 4 in (1, 3)
        max_tokens = rng.randint(4, 28)
        params = SamplingParams(
            max_tokens=28 if f"r{i}" == ABORTED else max_tokens,
            temperature=0.9 if seeded else 0.0,
            top_k=40 if i % 4 == 3 else 0,
            seed=100 + i if seeded else None,
            stop_token_ids=stop_ids if i % 3 == 0 else (),
            stop=("e", "o") if i % 6 == 5 else (),
            ignore_eos=True,
        )
        request = GenerateRequest(f"r{i}", prompt, params, tenant_id="ab"[i % 2])
        requests.append((6 * (i // 8), request))
    return requests


class Run(NamedTuple):
    tokens: dict[str, list[int]]
    text: dict[str, str]
    reasons: dict[str, str]
    engine: LLMEngine


def run(tiny: LoadedModel, overlap: bool, graphs: GraphMode = "off") -> Run:
    config = EngineConfig(
        page_size=4, num_pages=40, max_num_batched_tokens=48, max_num_seqs=8,
        speculative_tokens=0, cuda_graph_sizes=(1, 2, 4, 8),
    )  # fmt: skip
    engine = LLMEngine(
        tiny, config, prefix_cache_factory=RadixPrefixCache, decode_graphs=graphs, overlap=overlap
    )
    arrivals = workload()
    tokens: dict[str, list[int]] = {r.request_id: [] for _, r in arrivals}
    text = dict.fromkeys(tokens, "")
    reasons: dict[str, str] = {}
    steps = 0
    while arrivals or engine.has_unfinished:
        while arrivals and arrivals[0][0] <= steps:
            engine.add_request(arrivals.pop(0)[1])
        for output in engine.step():
            assert output.request_id not in reasons, "an output after the request finished"
            tokens[output.request_id] += output.token_ids
            text[output.request_id] += output.text
            if output.finished:
                reasons[output.request_id] = output.finish_reason or ""
        if ABORTED not in reasons and len(tokens[ABORTED]) >= ABORT_AFTER:
            assert engine.abort(ABORTED)
        steps += 1
        assert steps < 2_000
    return Run(tokens, text, reasons, engine)


def assert_every_page_back(engine: LLMEngine) -> None:
    pool = engine.cache.pool
    pool.check_integrity()
    engine.cache.check_integrity()
    assert all(not pool.owner(page).startswith("req:") for page in range(pool.num_pages))
    assert engine.cache.num_available_pages == pool.num_pages


@pytest.mark.parametrize("graphs", ["off", "eager"])
def test_overlapped_steps_give_the_same_outputs_and_free_every_page(
    tiny: LoadedModel, graphs: GraphMode
) -> None:
    plain = run(tiny, overlap=False, graphs=graphs)
    overlapped = run(tiny, overlap=True, graphs=graphs)
    # A call that reads an overlapped step and then runs one synchronously returns two tokens of
    # a request at once: the aborted one may have one token more when the test sees it.
    aborted = overlapped.tokens.pop(ABORTED)
    assert aborted[:ABORT_AFTER] == plain.tokens.pop(ABORTED)
    assert len(aborted) - ABORT_AFTER in (0, 1)
    assert overlapped.tokens == plain.tokens
    del plain.text[ABORTED], overlapped.text[ABORTED]
    assert overlapped.text == plain.text
    assert overlapped.reasons == plain.reasons
    reasons = set(plain.reasons.values())
    assert reasons == {"stop", "length", "abort"}, reasons
    assert plain.reasons[ABORTED] == "abort"
    stats, plain_stats = overlapped.engine.stats, plain.engine.stats
    assert plain_stats.num_overlapped_steps == 0
    assert stats.num_overlapped_steps > stats.num_steps // 3  # most decode steps overlapped
    assert stats.num_cached_tokens > 0  # shared prefixes were matched
    assert stats.num_preemptions > 0  # the pool was meant to force preemption
    assert stats.num_generated_tokens == plain_stats.num_generated_tokens
    for result in (plain, overlapped):
        assert not result.engine.has_unfinished
        assert_every_page_back(result.engine)


def test_overlap_is_off_on_a_cpu_unless_forced(tiny: LoadedModel) -> None:
    config = EngineConfig(num_pages=16, max_num_seqs=4)
    assert config.overlap_steps  # meant for CUDA
    assert not LLMEngine(tiny, config).overlap
    assert LLMEngine(tiny, config, overlap=True).overlap


def test_an_abort_while_a_step_is_in_flight_drops_its_token(tiny: LoadedModel) -> None:
    config = EngineConfig(page_size=4, num_pages=16, max_num_seqs=4, speculative_tokens=0)
    engine = LLMEngine(tiny, config, overlap=True)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine.add_request(GenerateRequest("a", [5, 6, 7, 8, 9], params))
    engine.add_request(GenerateRequest("b", [9, 8, 7], params))
    delivered = []
    for _ in range(3):  # the prefill, then two decodes: the second is in flight
        delivered += [o for o in engine.step() if o.request_id == "a"]
    assert engine.stats.num_overlapped_steps == 2
    assert sum(len(o.token_ids) for o in delivered) == 2  # the prefill's and the first decode's
    assert engine.abort("a")
    outputs = engine.step()
    ends = [o for o in outputs if o.request_id == "a"]
    assert [(o.token_ids, o.finish_reason) for o in ends] == [([], "abort")]
    assert [len(o.token_ids) for o in outputs if o.request_id == "b"] == [1]
    while engine.has_unfinished:
        engine.step()
    assert_every_page_back(engine)


def test_a_request_outgrowing_the_cache_gets_its_token_in_flight_first(tiny: LoadedModel) -> None:
    """Alone and out of pages, it ends by length when the next step is scheduled, while its
    last token is still in flight: that token comes first, then the end."""
    config = EngineConfig(page_size=4, num_pages=4, max_num_seqs=2, speculative_tokens=0)
    results = []
    for overlap in (False, True):
        engine = LLMEngine(tiny, config, overlap=overlap)
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        engine.add_request(GenerateRequest("long", list(range(20, 30)), params))
        outputs = []
        while engine.has_unfinished:
            outputs += engine.step()
        assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])
        results.append(([t for o in outputs for t in o.token_ids], outputs[-1].finish_reason))
        assert engine.stats.num_overlapped_steps > 0 or not overlap
        assert_every_page_back(engine)
    assert results[0] == results[1]
    assert results[0][1] == "length" and len(results[0][0]) == 16 - 10 + 1  # the pool is full


# --- the pieces, on made-up requests ----------------------------------------------------------


def _request(name: str, tokens: int, outputs: int, **params: object) -> Request:
    request = Request(
        request_id=name,
        prompt_token_ids=list(range(3, 3 + tokens - outputs)),
        params=SamplingParams(max_tokens=16, ignore_eos=True, **params),  # type: ignore[arg-type]
        tenant_id="t",
        namespace="t",
        owner=f"req:{name}",
        arrival_index=0,
    )
    for i in range(outputs):
        request.append_token(50 + i)
    request.num_computed_tokens = tokens - 1
    return request


def _out(seqs: list[ScheduledSeq]) -> SchedulerOutput:
    return SchedulerOutput(seqs=seqs, num_decodes=len(seqs), num_batched_tokens=len(seqs))


def test_only_plain_decodes_that_go_on_may_stay_in_flight() -> None:
    decode = ScheduledSeq(_request("a", 8, 2), 1, True)
    assert deferrable(_out([decode]), [decode], max_model_len=64)
    first = ScheduledSeq(_request("p", 8, 0), 1, True)  # a prompt's last token
    drafted = ScheduledSeq(_request("d", 8, 2), 3, True, (7, 7))
    logprobs = ScheduledSeq(_request("l", 8, 2, logprobs=1), 1, True)
    last = ScheduledSeq(_request("m", 8, 15), 1, True)  # its 16th token: ends by length
    for seq in (first, drafted, logprobs, last):
        assert not deferrable(_out([decode, seq]), [decode, seq], max_model_len=64), seq
    assert not deferrable(_out([decode]), [decode], max_model_len=9)  # the context ends
    preempted = _out([decode])
    preempted.preempted.append(_request("v", 8, 2))
    assert not deferrable(preempted, [decode], max_model_len=64)
    assert not deferrable(_out([decode, first]), [decode], max_model_len=64)  # one failed


def test_placeholders_are_filled_from_the_device_ids() -> None:
    a, b, c = _request("a", 6, 1), _request("b", 5, 1), _request("c", 9, 0)
    for request in (a, b):
        request.num_computed_tokens += 1
        request.append_placeholder()
    assert a.all_token_ids[-1] == PLACEHOLDER_TOKEN and a.token_in_flight
    rows = {a: 1, b: 0}  # their rows in the step in flight
    ids = torch.tensor([70, 71])
    # The same rows in the same order: one slice copy.
    same = [ScheduledSeq(b, 1, True), ScheduledSeq(a, 1, True)]
    assert pending_inputs(same, {a: 1, b: 0}) == ([0, 1], [0, 1])
    # c's prompt chunk first, then a and b's decodes: an indexed copy.
    mixed = [ScheduledSeq(c, 4, False), ScheduledSeq(a, 1, True), ScheduledSeq(b, 1, True)]
    positions, sources = pending_inputs(mixed, rows)
    assert (positions, sources) == ([4, 5], [1, 0])
    inputs = torch.zeros(6, dtype=torch.long)
    fill_inputs(inputs, positions, sources, ids)
    assert inputs.tolist() == [0, 0, 0, 0, 71, 70]
    # Preempted and admitted again in the same step: its placeholder ends its prompt's chunk.
    b.num_computed_tokens = 2
    again = [ScheduledSeq(a, 1, True), ScheduledSeq(b, 4, True)]
    assert pending_inputs(again, rows) == ([0, 4], [1, 0])
    assert pending_inputs([ScheduledSeq(b, 2, False)], rows) == ([], [])  # not reached yet
    a.settle_token(71)
    assert a.all_token_ids[-1] == a.output_token_ids[-1] == 71 and not a.token_in_flight
    with pytest.raises(ValueError, match="no token in flight"):
        a.settle_token(72)
