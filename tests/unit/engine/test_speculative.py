"""N-gram drafts: what the drafter proposes, and that the engine's output does not change."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel, load_model
from engine.outputs import GenerateRequest, RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.speculative import MAX_PAUSE, NgramDrafter
from radix_cache.radix_prefix_cache import RadixPrefixCache
from tests.support.greedy import run_all


def request_with(tokens: list[int], params: SamplingParams | None = None) -> Request:
    return Request(
        request_id="r",
        prompt_token_ids=list(tokens),
        params=params or SamplingParams(temperature=0.0, max_tokens=64),
        tenant_id="t",
        namespace="tenant:t",
        owner="req:r",
        arrival_index=0,
    )


def test_a_repeated_ngram_proposes_what_followed_it_last_time() -> None:
    drafter = NgramDrafter(num_tokens=3, ngram=2)
    request = request_with([5, 6, 7, 8, 9, 1, 2, 5, 6])
    assert drafter.propose(request, 8) == [7, 8, 9]
    assert drafter.propose(request, 2) == [7, 8]  # the limit wins over num_tokens
    # The most recent earlier occurrence counts.
    request.append_token(3)
    request.append_token(5)
    request.append_token(6)
    assert drafter.propose(request, 8) == [3, 5, 6]


def test_past_the_end_the_draft_repeats_with_the_period_of_the_match() -> None:
    drafter = NgramDrafter(num_tokens=7, ngram=3)
    request = request_with([1, 2, 3, 4, 2, 3, 4, 2, 3, 4])
    assert drafter.propose(request, 7) == [2, 3, 4, 2, 3, 4, 2]
    request = request_with([9, 9, 9, 9])
    assert drafter.propose(request, 7) == [9] * 7


def test_a_shorter_ngram_stands_in_when_the_longest_has_no_match() -> None:
    drafter = NgramDrafter(num_tokens=3, ngram=3, min_ngram=2)
    # (2, 3, 9) never occurred, (3, 9) did: what followed it.
    assert drafter.propose(request_with([3, 9, 4, 5, 1, 2, 3, 9]), 3) == [4, 5, 1]
    # Both occurred: the trigram's continuation wins over the more recent bigram's.
    request = request_with([7, 3, 9, 1, 1, 3, 9, 2, 2, 7, 3, 9])
    assert drafter.propose(request, 2) == [1, 1]
    assert NgramDrafter(num_tokens=2, ngram=2).propose(request, 2) == [2, 2]
    with pytest.raises(ValueError):
        NgramDrafter(num_tokens=2, ngram=2, min_ngram=3)


def test_no_match_short_contexts_and_sampled_requests_get_no_draft() -> None:
    drafter = NgramDrafter(num_tokens=4, ngram=3, min_ngram=3)
    assert drafter.propose(request_with([1, 2, 3, 4, 5, 6]), 4) == []
    assert drafter.propose(request_with([1, 1, 1]), 4) == []
    assert NgramDrafter(num_tokens=4, ngram=3).propose(request_with([1, 2, 3, 4, 5, 6]), 4) == []
    sampled = request_with([1, 1, 1, 1, 1], SamplingParams(temperature=0.7, max_tokens=9))
    assert drafter.propose(sampled, 4) == []
    assert drafter.propose(request_with([1, 1, 1, 1, 1]), 0) == []


def test_the_index_grows_with_new_tokens_only() -> None:
    drafter = NgramDrafter(num_tokens=4, ngram=3)
    rng = random.Random(0)
    request = request_with([rng.randrange(1000) for _ in range(500)])
    drafter.propose(request, 4)
    state = request.draft_state
    assert state is not None and state.num_indexed == 500
    size = len(state.index)
    request.append_token(7)
    drafter.propose(request, 4)
    assert state.num_indexed == 501 and len(state.index) <= size + 2  # a bigram and a trigram


def test_outright_misses_pause_drafting_longer_each_time_and_a_hit_resets() -> None:
    drafter = NgramDrafter(num_tokens=4, ngram=2)
    request = request_with([4, 4, 4, 4])
    assert drafter.propose(request, 4)
    pauses = []
    for _ in range(7):
        drafter.feedback(request, 4, 0)
        skipped = 0
        while not drafter.propose(request, 4):
            skipped += 1
        pauses.append(skipped)
    assert pauses == [1, 2, 4, 8, MAX_PAUSE, MAX_PAUSE, MAX_PAUSE]
    drafter.feedback(request, 4, 2)
    drafter.feedback(request, 4, 0)
    assert drafter.propose(request, 4) == []
    assert drafter.propose(request, 4) == [4, 4, 4, 4]  # a pause of one step again


# -- the engine ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


def run(
    tiny: LoadedModel, prompts: list[list[int]], params: SamplingParams, **config: object
) -> tuple[dict[str, list[RequestOutput]], LLMEngine]:
    options: dict[str, object] = {"num_pages": 64, "max_num_batched_tokens": 64, "max_num_seqs": 8}
    options.update(config)
    engine = LLMEngine(
        tiny,
        EngineConfig(**options),  # type: ignore[arg-type]
        prefix_cache_factory=RadixPrefixCache,
    )
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerateRequest(f"r{i}", prompt, params, tenant_id=f"t{i % 2}"))
    return run_all(engine), engine


def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        phrase = [rng.randrange(3, 250) for _ in range(rng.randrange(2, 6))]
        noise = [rng.randrange(3, 250) for _ in range(rng.randrange(0, 9))]
        prompts.append(noise + phrase * rng.randrange(3, 8))
    return prompts


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


@pytest.mark.parametrize("num_tokens", [1, 4])
@pytest.mark.parametrize("budget", [16, 64])
def test_greedy_outputs_are_the_same_with_drafts_in_fewer_steps(
    tiny: LoadedModel, num_tokens: int, budget: int
) -> None:
    prompts = repetitive_prompts(8)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain, plain_engine = run(
        tiny, prompts, params, speculative_tokens=0, max_num_batched_tokens=budget
    )
    drafted, engine = run(
        tiny, prompts, params, speculative_tokens=num_tokens, max_num_batched_tokens=budget
    )
    for i in range(len(prompts)):
        assert tokens(drafted[f"r{i}"]) == tokens(plain[f"r{i}"])
        assert len(tokens(drafted[f"r{i}"])) == 24
        assert "".join(o.text for o in drafted[f"r{i}"]) == "".join(o.text for o in plain[f"r{i}"])
        assert drafted[f"r{i}"][-1].finish_reason == "length"
    stats = engine.stats
    assert plain_engine.stats.num_draft_tokens == 0
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
    assert stats.num_generated_tokens == plain_engine.stats.num_generated_tokens
    assert stats.num_decode_tokens == plain_engine.stats.num_decode_tokens
    assert stats.num_steps < plain_engine.stats.num_steps
    # Every page came back: the rejected tails' pages were the requests' own.
    assert engine.cache.num_available_pages == engine.num_pages


def test_a_stop_inside_an_accepted_draft_ends_the_request_there(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    accepted: list[int] = []  # per drafted step, in order
    feedback = NgramDrafter.feedback

    def record(self: NgramDrafter, request: Request, num_drafted: int, num_accepted: int) -> None:
        accepted.append(num_accepted)
        feedback(self, request, num_drafted, num_accepted)

    monkeypatch.setattr(NgramDrafter, "feedback", record)
    prompts = repetitive_prompts(8, seed=1)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain, _ = run(tiny, prompts, params, speculative_tokens=0)
    cut_inside = 0
    for i, prompt in enumerate(prompts):
        text = "".join(o.text for o in plain[f"r{i}"])
        for end in range(8, len(text), 3):
            # A stop string that first completes late in the answer, where drafts run.
            stop_params = SamplingParams(
                max_tokens=24, temperature=0.0, ignore_eos=True, stop=(text[end - 6 : end],)
            )
            cut, _ = run(tiny, [prompt], stop_params, speculative_tokens=0, page_size=2)
            accepted.clear()
            drafted, engine = run(tiny, [prompt], stop_params, speculative_tokens=4, page_size=2)
            assert tokens(drafted["r0"]) == tokens(cut["r0"])
            assert "".join(o.text for o in drafted["r0"]) == "".join(o.text for o in cut["r0"])
            assert drafted["r0"][-1].finish_reason == cut["r0"][-1].finish_reason
            assert engine.cache.num_available_pages == engine.num_pages
            last_step = drafted["r0"][-1].token_ids
            if accepted and len(last_step) > 1 and len(last_step) < accepted[-1] + 1:
                cut_inside += 1  # the stop came before the end of the accepted draft
    assert cut_inside > 0


def test_cached_answers_hold_the_accepted_tokens_kv(tiny: LoadedModel) -> None:
    """A follow-up that reuses a drafted answer's cached pages continues exactly as one
    computed from scratch: no page holds a rejected draft token's KV."""
    prompts = repetitive_prompts(4, seed=2)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    first, engine = run(tiny, prompts, params, speculative_tokens=4, page_size=4, num_pages=256)
    follow = [p + tokens(first[f"r{i}"]) + [7, 8, 9] for i, p in enumerate(prompts)]
    expected, _ = run(tiny, follow, params, speculative_tokens=0, page_size=4)
    for i, prompt in enumerate(follow):
        engine.add_request(GenerateRequest(f"f{i}", prompt, params, tenant_id=f"t{i % 2}"))
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished:
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    for i in range(len(follow)):
        assert outputs[f"f{i}"][-1].num_cached_tokens > len(prompts[i])
        assert tokens(outputs[f"f{i}"]) == tokens(expected[f"r{i}"])


def test_sampled_requests_never_draft(tiny: LoadedModel) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    prompts = repetitive_prompts(4, seed=4)
    plain, _ = run(tiny, prompts, params, speculative_tokens=0)
    drafted, engine = run(tiny, prompts, params, speculative_tokens=4)
    assert engine.stats.num_draft_tokens == 0
    for i in range(len(prompts)):
        assert tokens(drafted[f"r{i}"]) == tokens(plain[f"r{i}"])
