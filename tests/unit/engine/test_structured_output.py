"""Grammar-constrained decoding in the engine, on the tiny random Llama (byte-level tokens).

Random weights make free text garbage, so every valid output here is the grammar's doing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel, load_model
from engine.outputs import GenerateRequest, RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.speculative import NgramDrafter
from engine.structured.compiler import GrammarCompiler
from engine.structured.spec import GrammarSpec
from radix_cache.radix_prefix_cache import RadixPrefixCache
from tests.support.greedy import run_all

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
    },
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}
REGEX = "[a-c]{3}-[0-9]+"
CHOICES = ["oui", "non", "été"]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


def make_engine(tiny: LoadedModel, **config: object) -> LLMEngine:
    options: dict[str, object] = {"num_pages": 96, "max_num_batched_tokens": 64, "max_num_seqs": 16}
    options.update(config)
    return LLMEngine(
        tiny,
        EngineConfig(**options),  # type: ignore[arg-type]
        prefix_cache_factory=RadixPrefixCache,
    )


def generate(
    engine: LLMEngine, params: list[SamplingParams], prompt: list[int] | None = None
) -> list[tuple[str, str | None, list[int]]]:
    """Text, finish reason and token ids of each request, all run together."""
    for i, p in enumerate(params):
        engine.add_request(GenerateRequest(f"r{i}", prompt or [5, 6, 7, 8, 9, 10] * 3, p))
    outputs = run_all(engine)
    return [result(outputs[f"r{i}"]) for i in range(len(params))]


def result(outputs: list[RequestOutput]) -> tuple[str, str | None, list[int]]:
    assert outputs[-1].error is None, outputs[-1].error
    text = "".join(o.text for o in outputs)
    return text, outputs[-1].finish_reason, [t for o in outputs for t in o.token_ids]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates_whatever_max_tokens_cuts(
    tiny: LoadedModel, temperature: float
) -> None:
    engine = make_engine(tiny)
    spec = GrammarSpec.json_schema(SCHEMA)
    budgets = [40, 48, 64, 96, 200]
    params = [
        SamplingParams(max_tokens=m, temperature=temperature, seed=m, grammar=spec) for m in budgets
    ]
    for (text, reason, token_ids), budget in zip(generate(engine, params), budgets, strict=True):
        jsonschema.validate(json.loads(text), SCHEMA)
        assert len(token_ids) <= budget
        assert reason in ("stop", "length")
        if reason == "length":  # closed within the budget, and not long before its end
            assert len(token_ids) >= budget - 10  # slack 3, plus a step of token and draft
    assert engine.cache.num_available_pages == engine.num_pages


def test_json_object_regex_and_choice(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    params = [
        SamplingParams(max_tokens=30, temperature=1.0, seed=1, grammar=GrammarSpec("json")),
        SamplingParams(max_tokens=30, temperature=1.0, seed=2, grammar=GrammarSpec("json")),
        SamplingParams(max_tokens=12, temperature=0.0, grammar=GrammarSpec("regex", REGEX)),
        SamplingParams(max_tokens=16, temperature=1.0, seed=3, grammar=GrammarSpec.choice(CHOICES)),
        SamplingParams(max_tokens=30, temperature=0.0),  # unconstrained, in the same steps
    ]  # fmt: skip
    (obj1, _, _), (obj2, _, _), (regex, _, _), (choice, reason, _), (free, _, _) = generate(
        engine, params
    )
    assert isinstance(json.loads(obj1), dict)
    assert isinstance(json.loads(obj2), dict)
    assert re.fullmatch(REGEX, regex)
    assert choice in CHOICES
    assert reason == "stop"
    assert not free.startswith("{")  # the mask touched only the constrained rows


def test_unconstrained_requests_keep_their_greedy_tokens(tiny: LoadedModel) -> None:
    plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    alone = generate(make_engine(tiny), [plain])[0][2]
    mixed = generate(
        make_engine(tiny), [plain, SamplingParams(max_tokens=16, grammar=GrammarSpec("json"))]
    )
    assert mixed[0][2] == alone


def test_a_draft_token_the_grammar_forbids_ends_acceptance(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prompt repeats "12x": after "12" the drafter guesses "x", which the grammar refuses."""
    proposals: list[list[int]] = []
    propose = NgramDrafter.propose

    def record(self: NgramDrafter, request: Request, limit: int) -> list[int]:
        draft = propose(self, request, limit)
        proposals.append(draft)
        return draft

    monkeypatch.setattr(NgramDrafter, "propose", record)
    prompt = list(b"12x" * 12)
    spec = GrammarSpec("regex", "[0-9]{6,12}")
    params = SamplingParams(max_tokens=30, temperature=0.0, grammar=spec)
    drafted_engine = make_engine(tiny, speculative_tokens=4)
    ((drafted, reason, _),) = generate(drafted_engine, [params], prompt)
    ((plain, _, _),) = generate(make_engine(tiny, speculative_tokens=0), [params], prompt)
    assert drafted == plain  # greedy under a grammar: the same tokens, drafts or not
    assert re.fullmatch("[0-9]{6,12}", drafted)
    assert any(ord("x") in draft for draft in proposals)  # forbidden guesses were made...
    stats = drafted_engine.stats
    assert stats.num_accepted_draft_tokens < stats.num_draft_tokens  # ...and rejected
    assert reason == "stop"  # the grammar ended it, well within max_tokens


def test_bad_grammars_and_ignore_eos_are_refused(tiny: LoadedModel) -> None:
    for spec, message in [
        (GrammarSpec("regex", "[a-"), "Unclosed"),
        (GrammarSpec("json_schema", '{"type": "nope"}'), "nope"),
        (GrammarSpec("choice", "[]"), "non-empty"),
    ]:
        with pytest.raises(InvalidRequestError, match=message) as info:
            spec.check("response_format")
        assert info.value.param == "response_format"
    engine = make_engine(tiny)
    params = SamplingParams(max_tokens=8, ignore_eos=True, grammar=GrammarSpec("json"))
    with pytest.raises(InvalidRequestError) as refused:
        engine.add_request(GenerateRequest("r", [5, 6, 7], params))
    assert refused.value.param == "ignore_eos"
    assert not engine.has_unfinished


def test_schema_grammars_keep_non_ascii_literals_and_refuse_control_characters(
    tiny: LoadedModel,
) -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"enum": ["Ünïcode", "q\\x41c"]},
            "b": {"type": "string", "maxLength": 3},
        },
        "required": ["a", "b"],
    }
    compiler = GrammarCompiler(tiny.tokenizer.hf, tiny.config.vocab_size, (258,))
    compiled = compiler.compile(GrammarSpec.json_schema(schema)).result()

    def accepts(text: str) -> bool:
        matcher = xgrammar.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.is_completed()

    assert accepts('{"a": "Ünïcode", "b": "é"}')
    assert accepts('{"a": "q\\\\x41c", "b": ""}')
    assert not accepts('{"a": "Ün\u0efcode", "b": ""}')
    assert not accepts('{"a": "Ünïcode", "b": "\x18"}')  # JSON forbids raw control characters
    compiler.close()


@pytest.mark.parametrize(
    ("spec", "prefix", "suffix"),
    [
        (GrammarSpec("json"), b'{"k": "', b'"}'),
        (GrammarSpec.json_schema(SCHEMA), b'{"name": "', b'", "n": 1, "tags": []}'),
        (GrammarSpec("regex", ".{1,3}"), b"", b""),
        (GrammarSpec("regex", "[\\u0000-\\uffff]+"), b"", b""),
        (GrammarSpec("regex", "[^a]+"), b"", b""),
    ],
)
def test_grammars_match_characters_never_surrogate_bytes(
    tiny: LoadedModel, spec: GrammarSpec, prefix: bytes, suffix: bytes
) -> None:
    # ED A0 80 encodes U+D800, which UTF-8 excludes: decoded, it is three U+FFFD, so a string of
    # at most n characters would come out longer than n.
    compiler = GrammarCompiler(tiny.tokenizer.hf, tiny.config.vocab_size, (258,))
    compiled = compiler.compile(spec).result()

    def accepts(middle: bytes) -> bool:
        matcher = xgrammar.GrammarMatcher(compiled)
        return matcher.accept_string(prefix + middle + suffix) and matcher.is_completed()

    assert accepts("é".encode()) and accepts("中".encode()) and accepts("\uffef".encode())
    assert not accepts(b"\xed\xa0\x80") and not accepts(b"\xed\xbf\xbf")
    if spec.kind != "regex" or "ffff" not in spec.value:
        assert accepts("😀".encode())
    compiler.close()


def test_chunked_prefill_and_prefix_hits_keep_the_grammar(tiny: LoadedModel) -> None:
    """A 150-token prompt in 32-token chunks beside decodes; the second wave hits the cache."""
    engine = make_engine(tiny, max_num_batched_tokens=32)
    prompt = [(7 * i) % 250 + 3 for i in range(150)]
    spec = GrammarSpec.json_schema(SCHEMA)
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=s, grammar=spec) for s in (1, 2)]
    first = generate(engine, params, prompt)
    for i, p in enumerate(params):
        engine.add_request(GenerateRequest(f"again{i}", prompt, p))
    outputs = run_all(engine)
    again = [result(outputs[f"again{i}"]) for i in range(2)]
    assert outputs["again0"][-1].num_cached_tokens >= 144  # the prompt's full pages
    for text, _, _ in first + again:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert [a[0] for a in again] == [f[0] for f in first]  # seeded: the same answers


def test_preempted_requests_resume_their_grammar(tiny: LoadedModel) -> None:
    """Answers of at least 135 tokens each, four at once in a cache of 224 tokens."""
    long_list = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 25}},
        "required": ["tags"],
        "additionalProperties": False,
    }
    engine = make_engine(tiny, num_pages=14, max_num_batched_tokens=64)
    spec = GrammarSpec.json_schema(long_list)
    params = [
        SamplingParams(max_tokens=160, temperature=1.0, seed=s, grammar=spec) for s in range(4)
    ]
    for text, _, _ in generate(engine, params):
        jsonschema.validate(json.loads(text), long_list)
    assert engine.stats.num_preemptions > 0
