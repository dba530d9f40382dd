"""The official openai client against the gateway on the real engine (tiny random model): logprobs,
penalties, logit_bias, stops, min_tokens, echo, prompt forms, n, max_completion_tokens, refusals
and the small endpoints, streamed and not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from litestar.testing import TestClient

from tests.integration.gateway_fakes import KEY_A, MODEL, make_runtime, make_tenancy, settings
from web.app import create_app
from web.tenancy.principal import InMemoryTenancy

MESSAGES: Any = [{"role": "user", "content": "hello there"}]
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}


class Gateway:
    def __init__(self, http: TestClient, tenancy: InMemoryTenancy) -> None:  # type: ignore[type-arg]
        self.http = http
        self.tenancy = tenancy
        self.client = openai.OpenAI(
            base_url="http://testserver/v1", api_key=KEY_A, http_client=http, max_retries=0
        )
        self.model = self.client.models.list().data[0].id


@pytest.fixture(scope="module")
def gw(tiny_llama_dir: Path) -> Iterator[Gateway]:
    tenancy = make_tenancy()
    config = settings(
        model=str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_bytes=8 * 2**20,
        speculative_tokens=4, engine_process=False,
    )  # fmt: skip
    app = create_app(config, store=tenancy, include_admin=False)
    with TestClient(app) as http:
        yield Gateway(http, tenancy)


def chat(gw: Gateway, **args: Any) -> Any:
    return gw.client.chat.completions.create(model=gw.model, messages=MESSAGES, **args)


def chat_stream(gw: Gateway, **args: Any) -> list[Any]:
    return list(chat(gw, stream=True, stream_options={"include_usage": True}, **args))


def complete(gw: Gateway, **args: Any) -> Any:
    args.setdefault("prompt", "one")  # greedy on the tiny model: printable ASCII
    return gw.client.completions.create(model=gw.model, **args)


def test_chat_logprobs_streamed_and_not(gw: Gateway) -> None:
    whole = chat(gw, max_tokens=6, logprobs=True, top_logprobs=3, **GREEDY)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.token == entry.top_logprobs[0].token  # greedy: the best token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.logprob <= 0 and bytes(entry.bytes or []) == entry.token.encode()
    chunks = chat_stream(gw, max_tokens=6, logprobs=True, top_logprobs=3, **GREEDY)
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in content
    ]
    assert chat(gw, max_tokens=2).choices[0].logprobs is None  # not asked, not sent


def test_completion_logprobs_streamed_and_not(gw: Gateway) -> None:
    whole = complete(gw, max_tokens=5, logprobs=2, **GREEDY)
    logprobs = whole.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]
    assert all(
        token in top for token, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True)
    )
    chunks = list(complete(gw, max_tokens=5, logprobs=2, stream=True, **GREEDY))
    tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    assert tokens == logprobs.tokens


def test_logit_bias_and_penalties(gw: Gateway) -> None:
    forced_id = 72  # "H" in the byte-level vocabulary
    forced = chat(gw, max_tokens=5, logit_bias={str(forced_id): 100}, **GREEDY)
    assert forced.choices[0].message.content == "HHHHH"
    chunks = chat_stream(gw, max_tokens=5, logit_bias={str(forced_id): 100}, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "HHHHH"
    plain = complete(gw, max_tokens=16, **GREEDY).choices[0].text
    spread = (
        complete(gw, max_tokens=16, presence_penalty=2, frequency_penalty=2, **GREEDY)
        .choices[0]
        .text
    )
    assert len(set(spread)) > len(set(plain))
    extra = {"ignore_eos": True, "repetition_penalty": 2.0}
    repeated = complete(gw, max_tokens=16, temperature=0, extra_body=extra).choices[0].text
    assert repeated != plain


def test_stop_strings_stop_token_ids_and_min_tokens(gw: Gateway) -> None:
    text = complete(gw, max_tokens=12, **GREEDY).choices[0].text
    stop = text[4:6]
    cut = complete(gw, max_tokens=12, stop=[stop], **GREEDY).choices[0]
    assert (cut.text, cut.finish_reason) == (text[: text.index(stop)], "stop")
    extra = {"ignore_eos": True, "include_stop_str_in_output": True}
    kept = complete(gw, max_tokens=12, stop=[stop], temperature=0, extra_body=extra)
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]
    first_id = ord(text[0])  # byte-level: a printable character is its own id
    by_id = complete(gw, max_tokens=12, temperature=0, extra_body={"stop_token_ids": [first_id]})
    assert by_id.choices[0].finish_reason == "stop"
    held = complete(gw, max_tokens=12, temperature=0,
                    extra_body={"stop_token_ids": [first_id], "min_tokens": 4})  # fmt: skip
    assert text[0] not in held.choices[0].text[:4]
    assert held.usage.completion_tokens >= 4


def test_echo_and_the_four_prompt_forms(gw: Gateway) -> None:
    echoed = complete(gw, max_tokens=3, echo=True, **GREEDY).choices[0].text
    alone = complete(gw, max_tokens=3, **GREEDY).choices[0].text
    assert echoed == "one" + alone
    chunks = list(complete(gw, max_tokens=3, echo=True, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed
    ids = gw.http.post(
        "/tokenize", json={"prompt": "one"}, headers={"Authorization": f"Bearer {KEY_A}"}
    ).json()["tokens"]
    assert complete(gw, prompt=ids, max_tokens=3, **GREEDY).choices[0].text == alone
    batch = complete(gw, prompt=["one", "other"], max_tokens=3, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == alone
    by_ids = complete(gw, prompt=[ids, ids[:3]], max_tokens=3, **GREEDY)
    assert by_ids.choices[0].text == alone
    assert by_ids.usage.prompt_tokens == len(ids) + 3
    with pytest.raises(openai.BadRequestError) as info:
        complete(gw, prompt=["x", 3], max_tokens=1)
    assert info.value.body["param"] == "prompt"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        complete(gw, max_tokens=1, echo=True, logprobs=1)
    assert info.value.body["param"] == "echo"  # type: ignore[index]


def test_n_choices_share_the_prompt_and_count_it_once(gw: Gateway) -> None:
    long = [{"role": "user", "content": "a long shared question " * 6}]
    before = len(gw.tenancy.usage)
    answer = gw.client.chat.completions.create(
        model=gw.model, messages=long, n=3, max_tokens=4, temperature=1.0, seed=3,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert len({c.message.content for c in answer.choices}) > 1  # seeds 3, 4 and 5
    single = gw.client.chat.completions.create(
        model=gw.model,
        messages=long,
        max_tokens=1,
        extra_body={"ignore_eos": True},  # type: ignore[arg-type]
    )
    usage = answer.usage
    assert usage.prompt_tokens == single.usage.prompt_tokens  # the prompt once
    assert usage.completion_tokens == 12  # every choice
    records = gw.tenancy.usage[before:]
    assert records[0].completion_tokens == 12 and records[0].prompt_tokens == usage.prompt_tokens
    chunks = list(gw.client.chat.completions.create(
        model=gw.model, messages=long, n=2, max_tokens=3, seed=3, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))  # fmt: skip
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    assert [texts[0], texts[1]] == [c.message.content[:3] for c in answer.choices[:2]]
    assert chunks[-1].usage.completion_tokens == 6
    batch = complete(gw, prompt=["one", "two"], n=2, max_tokens=2, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text  # greedy twins


def test_max_completion_tokens_streamed_and_not(gw: Gateway) -> None:
    whole = chat(gw, max_completion_tokens=3, **GREEDY)
    assert whole.usage.completion_tokens == 3 and whole.choices[0].finish_reason == "length"
    chunks = chat_stream(gw, max_completion_tokens=3, **GREEDY)
    assert chunks[-1].usage.completion_tokens == 3


@pytest.mark.parametrize(
    ("endpoint", "extra", "param"),
    [
        ("chat", {"frobnicate": True}, "frobnicate"),
        ("chat", {"audio": {"voice": "alloy"}}, "audio"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ("completion", {"suffix": "end"}, "suffix"),
        ("completion", {"best_of": 3}, "best_of"),
        ("completion", {"guided_grammar": 'root ::= "a"'}, "guided_grammar"),
    ],
)
def test_refusals_name_the_parameter(
    gw: Gateway, endpoint: str, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            chat(gw, max_tokens=1, extra_body=extra)
        else:
            complete(gw, max_tokens=1, extra_body=extra)
    assert info.value.body["param"] == param  # type: ignore[index]


def test_fields_without_effect_are_accepted(gw: Gateway) -> None:
    answer = chat(gw, max_tokens=2, user="u1", metadata={"k": "v"}, store=False,
                  service_tier="auto", **GREEDY)  # fmt: skip
    assert answer.usage.completion_tokens == 2


def test_model_card_and_tokenize_round_trip(gw: Gateway) -> None:
    assert gw.client.models.retrieve(gw.model).id == gw.model
    with pytest.raises(openai.NotFoundError):
        gw.client.models.retrieve("no-such-model")
    auth = {"Authorization": f"Bearer {KEY_A}"}
    body = {"model": gw.model, "prompt": "héllo", "return_token_strs": True}
    tokens = gw.http.post("/tokenize", json=body, headers=auth).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"])
    assert tokens["max_model_len"] > 0
    text = gw.http.post("/detokenize", json={"tokens": tokens["tokens"]}, headers=auth).json()
    assert text == {"prompt": "héllo"}
    chat_ids = gw.http.post("/tokenize", json={"messages": MESSAGES}, headers=auth).json()
    usage = chat(gw, max_tokens=1, **GREEDY).usage
    assert chat_ids["count"] == usage.prompt_tokens
    assert gw.http.post("/tokenize", json={"prompt": "x"}).status_code == 401
    refused = gw.http.post("/detokenize", json={"tokens": [10**9]}, headers=auth)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"
    unknown = gw.http.post("/tokenize", json={"prompt": "x", "wat": 1}, headers=auth)
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "wat"


def test_served_model_name_is_the_name_requests_use(tiny_llama_dir: Path) -> None:
    config = settings(
        model=str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_bytes=2**20,
        engine_process=False, served_model_name="org/tiny",
    )  # fmt: skip
    app = create_app(config, store=make_tenancy(), include_admin=False)
    with TestClient(app) as http:
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key=KEY_A, http_client=http, max_retries=0
        )
        assert [m.id for m in client.models.list().data] == ["org/tiny"]
        assert client.models.retrieve("org/tiny").id == "org/tiny"
        answer = client.completions.create(model="org/tiny", prompt="one", max_tokens=2)
        assert answer.model == "org/tiny" and answer.usage.completion_tokens >= 1
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=tiny_llama_dir.name, prompt="one", max_tokens=2)


def test_an_engine_without_logprobs_refuses_them(tiny_llama_dir: Path) -> None:
    runtime, _ = make_runtime(tiny_llama_dir)
    runtime.unsupported_params = frozenset({"logprobs"})
    app = create_app(settings(), engine=runtime, store=make_tenancy(), include_admin=False)
    with TestClient(app) as http:
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key=KEY_A, http_client=http, max_retries=0
        )
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="one", max_tokens=2, logprobs=1)
        assert info.value.body["param"] == "logprobs"  # type: ignore[index]
        assert client.completions.create(model=MODEL, prompt="one", max_tokens=2).choices


class RecordingTenancy(InMemoryTenancy):
    """Keeps what each admission reserved."""

    def __init__(self) -> None:
        super().__init__()
        self.reserved: list[tuple[int, int]] = []

    async def admit(self, principal: Any, request_id: str, prompt_tokens: int, max_tokens: int,
                    *, model: str | None = None) -> Any:  # fmt: skip
        self.reserved.append((prompt_tokens, max_tokens))
        return await super().admit(principal, request_id, prompt_tokens, max_tokens, model=model)


def test_quotas_reserve_every_prompt_once_and_every_choice(tiny_llama_dir: Path) -> None:
    runtime, engine = make_runtime(tiny_llama_dir)
    tenancy = RecordingTenancy()
    tenancy.keys = make_tenancy().keys
    app = create_app(settings(), engine=runtime, store=tenancy, include_admin=False)
    with TestClient(app) as http:
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key=KEY_A, http_client=http, max_retries=0
        )
        answer = client.completions.create(model=MODEL, prompt=["ab", "cde"], n=2, max_tokens=5)
    assert tenancy.reserved == [(2 + 3, 4 * 5)]  # byte-level tokens: 2 and 3
    assert len(engine.requests) == 4
    assert answer.usage.prompt_tokens == 5 and answer.usage.completion_tokens == 20
    assert tenancy.usage[0].completion_tokens == 20
