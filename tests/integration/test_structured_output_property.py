"""Property: for random JSON schemas of a bounded size, constrained generation on the real
default model (SmolLM2-135M-Instruct) always yields JSON that validates, greedy or sampled, and
however ``max_tokens`` cuts it."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams
from engine.structured.spec import GrammarSpec
from radix_cache.radix_prefix_cache import RadixPrefixCache
from tests.support.greedy import run_all
from web.openai.structured_output import GrammarLimits

pytestmark = pytest.mark.slow

KEYS = ["id", "name", "city", "tags", "score", "ok", "kind", "note"]
WORDS = ["red", "green", "blue", "x y", "Ünïcode"]


def leaf() -> st.SearchStrategy[dict[str, Any]]:
    string = st.builds(
        lambda n: {"type": "string", **({} if n is None else {"maxLength": n})},
        st.none() | st.integers(1, 8),
    )
    integer = st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 1000),
    )
    return st.one_of(
        string,
        integer,
        st.just({"type": "integer"}),
        st.just({"type": "number"}),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.lists(st.sampled_from(WORDS), min_size=1, max_size=3, unique=True).map(
            lambda words: {"enum": words}
        ),
    )


def objects(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    def build(props: dict[str, dict[str, Any]], data: st.DataObject) -> dict[str, Any]:
        keys = sorted(props)
        required = data.draw(st.lists(st.sampled_from(keys), unique=True)) if keys else []
        return {
            "type": "object",
            "properties": props,
            "required": sorted(required),
            "additionalProperties": False,
        }

    return st.builds(
        build, st.dictionaries(st.sampled_from(KEYS), children, min_size=1, max_size=4), st.data()
    )


def arrays(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(
        lambda items, n: {"type": "array", "items": items, "maxItems": n},
        children,
        st.integers(1, 3),
    )


SCHEMAS = objects(st.recursive(leaf(), lambda inner: objects(inner) | arrays(inner), max_leaves=6))


@pytest.fixture(scope="module")
def limits(default_model_fp32: LoadedModel) -> GrammarLimits:
    return GrammarLimits(default_model_fp32.tokenizer)


@pytest.fixture(scope="module")
def engine(default_model_fp32: LoadedModel) -> LLMEngine:
    return LLMEngine(
        default_model_fp32,
        EngineConfig(dtype="float32", num_pages=256, max_num_batched_tokens=256, max_num_seqs=8),
        prefix_cache_factory=RadixPrefixCache,
    )


@settings(
    max_examples=4,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure prints its example as is
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    st.lists(
        st.tuples(SCHEMAS, st.sampled_from([0.0, 0.8]), st.integers(24, 64)),
        min_size=4,
        max_size=4,
    )
)
def test_constrained_output_always_validates(
    engine: LLMEngine, limits: GrammarLimits, cases: list[tuple[dict[str, Any], float, int]]
) -> None:
    """Every request the gateway admits (its max_tokens fits the shortest valid answer, else
    a 400) ends in JSON that validates."""
    tokenizer = engine.tokenizer
    budgets = []
    for schema, _, asked in cases:
        shortest = limits.shortest(GrammarSpec.json_schema(schema))
        assert shortest is not None
        budgets.append(max(asked, shortest))
    for i, ((schema, temperature, _), max_tokens) in enumerate(zip(cases, budgets, strict=True)):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Answer in JSON: {json.dumps(schema)}"}]
        )
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            seed=i,
            grammar=GrammarSpec.json_schema(schema),
        )
        engine.add_request(GenerateRequest(f"r{i}", prompt, params))
    outputs = run_all(engine)
    for i, ((schema, _, _), max_tokens) in enumerate(zip(cases, budgets, strict=True)):
        last = outputs[f"r{i}"][-1]
        assert last.error is None, last.error
        text = "".join(o.text for o in outputs[f"r{i}"])
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise AssertionError(f"{text!r} ({last.finish_reason}) does not parse") from exc
        jsonschema.validate(value, schema)
        assert last.num_output_tokens <= max_tokens
        assert last.finish_reason in ("stop", "length")
