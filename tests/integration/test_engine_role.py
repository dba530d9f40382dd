"""The engine role's model-server API on the tiny model: the engine token guards every route
but /health, the tenant comes from the body's fields, and /metrics speaks the routers' names."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.gateway_fakes import settings
from web.engine_api import create_engine_app

TOKEN = "engine-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# What the llm-d endpoint picker reads from a model server (its default metric names).
PICKER_GAUGES = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
)
PROMPT = "a shared system prompt, long enough to fill several pages of sixteen tokens " * 3


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[tuple[TestClient, str]]:  # type: ignore[type-arg]
    config = settings(
        model=str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_bytes=8 * 2**20,
        role="engine", engine_token=TOKEN,
    )  # fmt: skip
    with TestClient(create_engine_app(config)) as client:
        model = client.get("/v1/models", headers=AUTH).json()["data"][0]["id"]
        yield client, model


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
     ("GET", "/metrics"), ("GET", "/server_info"), ("GET", "/model_info"),
     ("GET", "/atrium/v1/state"), ("GET", "/version")],
)  # fmt: skip
@pytest.mark.parametrize("header", [None, "Bearer wrong-token", "Basic x", f"bearer {TOKEN}x"])
def test_every_route_but_health_needs_the_engine_token(
    engine: tuple[TestClient, str],  # type: ignore[type-arg]
    method: str,
    path: str,
    header: str | None,
) -> None:
    client, model = engine
    headers = {} if header is None else {"Authorization": header}
    body = {"model": model, "prompt": "hi", "cache_salt": "intruder", "max_tokens": 2}
    answer = client.request(method, path, headers=headers, json=body if method == "POST" else None)
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "invalid_engine_token"


def test_health_is_open(engine: tuple[TestClient, str]) -> None:  # type: ignore[type-arg]
    client, _ = engine
    assert client.get("/health").status_code == 200


def complete(client: TestClient, model: str, salt: str, **extra: object) -> dict:  # type: ignore[type-arg]
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
            "cache_salt": salt, **extra}  # fmt: skip
    answer = client.post("/v1/completions", json=body, headers=AUTH)
    assert answer.status_code == 200, answer.text
    result: dict = answer.json()  # type: ignore[type-arg]
    return result


def test_cache_salt_is_the_tenant_namespace(engine: tuple[TestClient, str]) -> None:  # type: ignore[type-arg]
    client, model = engine
    first = complete(client, model, "tenant-one")["usage"]
    again = complete(client, model, "tenant-one")["usage"]
    other = complete(client, model, "tenant-two")["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["prompt_tokens_details"]["cached_tokens"] > 0
    assert other["prompt_tokens_details"]["cached_tokens"] == 0
    # The state is the engine's latest snapshot, sent when it goes idle: it may trail the
    # last answer by a moment.
    deadline = time.monotonic() + 5.0
    while True:
        state = client.get("/atrium/v1/state", headers=AUTH).json()
        namespaces = set(state["cache_by_namespace"])
        if {"tenant:tenant-one", "tenant:tenant-two"} <= namespaces or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert {"tenant:tenant-one", "tenant:tenant-two"} <= namespaces


@pytest.mark.parametrize(
    ("field", "value"),
    [("cache_salt", ""), ("cache_salt", "x" * 300), ("atrium_tenant_weight", 0),
     ("atrium_tenant_weight", -1.5), ("atrium_kv_cache_share", 1.5),
     ("atrium_prompt_token_ids", []), ("atrium_prompt_token_ids", [10**9]),
     ("atrium_sampling", {"max_tokens": "many"})],
)  # fmt: skip
def test_bad_tenant_fields_are_400(
    engine: tuple[TestClient, str],  # type: ignore[type-arg]
    field: str,
    value: object,
) -> None:
    client, model = engine
    body = {"model": model, "prompt": "hi", "max_tokens": 2, field: value}
    answer = client.post("/v1/completions", json=body, headers=AUTH)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == field


def test_stream_carries_usage_in_every_chunk(engine: tuple[TestClient, str]) -> None:  # type: ignore[type-arg]
    client, model = engine
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stream": True, "cache_salt": "tenant-one", "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    answer = client.post("/v1/chat/completions", json=body, headers=AUTH)
    frames = [f.removeprefix("data: ") for f in answer.text.split("\n\n") if f]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 4
    assert all(c["usage"]["prompt_tokens"] > 0 for c in chunks)


def test_metrics_carry_the_names_the_endpoint_picker_reads(engine: tuple[TestClient, str]) -> None:  # type: ignore[type-arg]
    client, model = engine
    complete(client, model, "tenant-metrics")
    text = client.get("/metrics", headers=AUTH).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in PICKER_GAUGES:
        assert families[name].type == "gauge", name
        (sample,) = families[name].samples
        assert sample.labels == {"model_name": model}
    (usage,) = families["vllm:kv_cache_usage_perc"].samples
    assert 0.0 <= usage.value <= 1.0
    (config,) = families["vllm:cache_config_info"].samples
    assert int(config.labels["block_size"]) == 16
    assert int(config.labels["num_gpu_blocks"]) > 0
    hits = families["vllm:prefix_cache_hits"].samples[0].value
    queries = families["vllm:prefix_cache_queries"].samples[0].value
    assert 0 < hits < queries
    assert "atrium_requests_total" in text  # Atrium's own beside them


@pytest.mark.parametrize(
    ("field", "value"),
    [("response_format", {"type": "json_object"}), ("suffix", "x"), ("best_of", 2), ("echo", True),
     ("priority", 3), ("stream_options", {"include_obfuscation": True})],
)  # fmt: skip
def test_fields_the_engine_would_not_honour_are_named(
    engine: tuple[TestClient, str],  # type: ignore[type-arg]
    field: str,
    value: object,
) -> None:
    client, model = engine
    body = {"model": model, "prompt": "hi", "max_tokens": 2, field: value}
    answer = client.post("/v1/completions", json=body, headers=AUTH)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "unsupported_parameter"
    assert answer.json()["error"]["param"].startswith(field)


def test_defaults_a_router_adds_are_accepted(engine: tuple[TestClient, str]) -> None:  # type: ignore[type-arg]
    client, model = engine
    body = {"model": model, "prompt": "hi", "max_tokens": 2, "echo": False, "n": 1,
            "stream": False, "logprobs": None, "cache_salt": "tenant-one"}  # fmt: skip
    assert client.post("/v1/completions", json=body, headers=AUTH).status_code == 200


@pytest.mark.parametrize("n", [0, 17, "3"])
def test_n_is_taken_up_to_the_tenant_apis_limit(
    engine: tuple[TestClient, str],  # type: ignore[type-arg]
    n: object,
) -> None:
    client, model = engine
    body = {"model": model, "prompt": "hi", "max_tokens": 2, "n": n}
    answer = client.post("/v1/completions", json=body, headers=AUTH)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "n"
    if n == 17:
        assert "between 1 and 16" in answer.json()["error"]["message"]


def test_a_gateway_gets_each_choice_of_n_with_its_own_counts(
    engine: tuple[TestClient, str],  # type: ignore[type-arg]
) -> None:
    client, model = engine
    sampling = {"max_tokens": 4, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    body = {"model": model, "prompt": PROMPT, "n": 3, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "atrium_sampling": sampling, "cache_salt": "tenant-n"}  # fmt: skip
    answer = client.post("/v1/completions", json=body, headers=AUTH)
    assert answer.status_code == 200, answer.text
    frames = [f.removeprefix("data: ") for f in answer.text.split("\n\n") if f]
    chunks = [json.loads(f) for f in frames[:-1]]
    counts: dict[int, dict[str, int]] = {}
    for chunk in chunks:
        if chunk["choices"]:
            (choice,) = chunk["choices"]
            assert chunk["atrium_choice_usage"]["index"] == choice["index"]
            counts[choice["index"]] = chunk["atrium_choice_usage"]
    assert {i: c["completion_tokens"] for i, c in counts.items()} == {0: 4, 1: 4, 2: 4}
    # The prompt was computed once: the later choices found its full pages cached.
    cached = [counts[i]["cached_tokens"] for i in range(3)]
    assert cached[0] == 0 and cached[1] == cached[2] == (len(PROMPT) - 1) // 16 * 16
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == len(PROMPT)  # counted once
    assert usage["completion_tokens"] == 12
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    plain = {k: v for k, v in body.items() if k != "atrium_sampling"}
    answer = client.post("/v1/completions", json=plain, headers=AUTH)
    assert "atrium_choice_usage" not in answer.text  # only for a gateway


def test_a_gateway_gets_logprobs_by_token_id(engine: tuple[TestClient, str]) -> None:  # type: ignore[type-arg]
    client, model = engine
    sampling = {"max_tokens": 3, "temperature": 0.0, "logprobs": 2, "ignore_eos": True}
    body = {"model": model, "prompt": "hi there", "max_tokens": 3, "stream": True,
            "atrium_sampling": sampling, "cache_salt": "tenant-one"}  # fmt: skip
    answer = client.post("/v1/completions", json=body, headers=AUTH)
    chunks = [json.loads(f.removeprefix("data: ")) for f in answer.text.split("\n\n")[:-2]]
    raw = [entry for c in chunks for entry in c.get("atrium_logprobs") or []]
    assert len(raw) == 3
    for token_id, logprob, top in raw:
        assert isinstance(token_id, int) and logprob <= 0.0
        assert len(top) == 2 and top[0][1] >= top[1][1]
    plain = {k: v for k, v in body.items() if k != "atrium_sampling"} | {"logprobs": 2}
    answer = client.post("/v1/completions", json=plain, headers=AUTH)
    assert "atrium_logprobs" not in answer.text  # only for a gateway


def test_an_unstreamed_answer_carries_the_logprobs_asked_for(
    engine: tuple[TestClient, str],  # type: ignore[type-arg]
) -> None:
    client, model = engine
    result = complete(client, model, "tenant-one", logprobs=2, ignore_eos=True)
    logprobs = result["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == result["usage"]["completion_tokens"] == 2
    assert all(lp <= 0.0 for lp in logprobs["token_logprobs"])
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"])


def test_a_non_positive_max_completion_tokens_is_refused_as_the_tenant_api_refuses_it(
    engine: tuple[TestClient, str],  # type: ignore[type-arg]
) -> None:
    client, model = engine
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 0, "cache_salt": "tenant-one"}  # fmt: skip
    answer = client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "max_completion_tokens"


def test_a_gateway_grammar_crosses_in_the_sampling_settings(engine: tuple[TestClient, str]) -> None:  # type: ignore[type-arg]
    client, model = engine
    grammar = {"kind": "choice", "value": json.dumps(["yes", "no"])}
    sampling = {"max_tokens": 8, "temperature": 1.0, "seed": 3, "grammar": grammar}
    body = {"model": model, "prompt": "Answer:", "max_tokens": 8, "atrium_sampling": sampling,
            "cache_salt": "tenant-one"}  # fmt: skip
    answer = client.post("/v1/completions", json=body, headers=AUTH)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] in ("yes", "no")


def test_a_lora_adapter_named_by_the_gateway_is_applied(
    engine: tuple[TestClient, str],  # type: ignore[type-arg]
    tiny_llama_dir: Path,
    tmp_path: Path,
) -> None:
    from engine.outputs import GenerateRequest
    from engine.sampling_params import SamplingParams
    from tests.support.lora import make_adapter
    from web.engine_api.client import request_body

    client, model = engine
    folder = make_adapter(
        tiny_llama_dir, tmp_path / "a", 5, 4, 8.0, ["q_proj", "v_proj", "down_proj"]
    )
    lora = {"atrium_lora_id": "la_test", "atrium_lora_path": str(folder)}
    base = complete(client, model, "lora-tenant", max_tokens=8)
    tuned = complete(client, model, "lora-tenant", max_tokens=8, **lora)
    assert tuned["choices"][0]["text"] != base["choices"][0]["text"]
    # The base model's pages of the same prompt are not the adapter's.
    assert tuned["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = complete(client, model, "lora-tenant", max_tokens=8, **lora)
    assert again["choices"][0]["text"] == tuned["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    bad = [
        {"atrium_lora_id": "la_test"},
        {"atrium_lora_path": str(folder)},
        {"atrium_lora_id": "la_x", "atrium_lora_path": "relative"},
        {"atrium_lora_id": "la_y", "atrium_lora_path": str(tmp_path / "missing")},
    ]
    for fields in bad:
        body = {"model": model, "prompt": "hi", "max_tokens": 2, **fields}
        answer = client.post("/v1/completions", json=body, headers=AUTH)
        assert answer.status_code == 400, (fields, answer.text)
    # What a gateway sends for an adapter request.
    params = SamplingParams(max_tokens=2)
    request = GenerateRequest("r", [1, 2], params, lora_name="la_1", lora_path="/srv/a")
    sent = request_body(request, model, "hi")
    assert (sent["atrium_lora_id"], sent["atrium_lora_path"]) == ("la_1", "/srv/a")
    assert "atrium_lora_id" not in request_body(GenerateRequest("r", [1], params), model, "hi")


def handed_to_engine(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> list[Any]:  # type: ignore[type-arg]
    """The engine requests the server hands over from now on (its engine's ``generate``, spied)."""
    runtime = client.app.state.generation.runtime
    seen: list[Any] = []
    generate = runtime.engine.generate

    def spy(request: Any) -> Any:
        seen.append(request)
        return generate(request)

    monkeypatch.setattr(runtime.engine, "generate", spy)
    return seen


def test_background_work_is_marked_from_the_gateway_to_the_engine(
    engine: tuple[TestClient, str],  # type: ignore[type-arg]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine.outputs import GenerateRequest
    from engine.sampling_params import SamplingParams
    from web.engine_api.client import request_body

    client, model = engine
    params = SamplingParams(max_tokens=2)
    line = request_body(GenerateRequest("r", [1, 2], params, background=True), model, "hi")
    assert line["atrium_background"] is True
    assert "atrium_background" not in request_body(GenerateRequest("r", [1], params), model, "hi")
    seen = handed_to_engine(client, monkeypatch)
    for flag in (True, False):
        body = {"model": model, "prompt": "hi", "max_tokens": 2, "atrium_background": flag}
        assert client.post("/v1/completions", json=body, headers=AUTH).status_code == 200
    assert [r.background for r in seen] == [True, False]
    body = {"model": model, "prompt": "hi", "max_tokens": 2, "atrium_background": "yes"}
    refused = client.post("/v1/completions", json=body, headers=AUTH)
    assert refused.status_code == 400 and "atrium_background" in refused.text


def test_the_gateways_count_of_a_tenants_requests_reaches_the_engine(
    engine: tuple[TestClient, str],  # type: ignore[type-arg]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine.outputs import GenerateRequest
    from engine.sampling_params import SamplingParams
    from web.engine_api.client import request_body

    client, model = engine
    params = SamplingParams(max_tokens=2)
    sent = request_body(GenerateRequest("r", [1, 2], params, tenant_requests=7), model, "hi")
    assert sent["atrium_tenant_requests"] == 7
    assert "atrium_tenant_requests" not in request_body(
        GenerateRequest("r", [1], params), model, ""
    )
    seen = handed_to_engine(client, monkeypatch)
    body = {"model": model, "prompt": "hi", "max_tokens": 2, "atrium_tenant_requests": 12}
    assert client.post("/v1/completions", json=body, headers=AUTH).status_code == 200
    assert seen[-1].tenant_requests == 12  # the gateway's count, larger than this server's own
    for bad in (-1, 10**7, "many"):
        body = {"model": model, "prompt": "hi", "max_tokens": 2, "atrium_tenant_requests": bad}
        refused = client.post("/v1/completions", json=body, headers=AUTH)
        assert refused.status_code == 400 and "atrium_tenant_requests" in refused.text
