"""LoRA adapters on every served model: an adapter registered for the second of two models of
different shapes runs on that model's engine, token-identical to PEFT's merged model; the base
model is checked at registration, shown as the adapter's ``parent``, and an adapter whose base
model this server does not serve is as absent as an unknown model. The gateway role sends an
adapter's request to its base model's engines."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from litestar import Litestar
from litestar.testing import TestClient

from engine.outputs import GenerateRequest, RequestOutput
from engine.tokenizer import Tokenizer
from tests.integration.gateway_fakes import settings
from tests.integration.test_admin_app import ADMIN_TOKEN, assert_error, migrated_sqlite
from tests.integration.test_gateway_lora import admin, lora_settings, tenant_key
from tests.integration.test_gateway_remote_engine import CutStream, frame
from tests.support.greedy import hf_greedy
from tests.support.lora import make_adapter, merged_reference
from tests.support.tiny_llama import load_reference, make_tiny_llama
from web.app import create_app
from web.engine_api.client import HttpEngineClient
from web.engine_api.gateway import remote_runtimes

Client = TestClient[Litestar]
ROUTE = "/admin/v1/lora-adapters"
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = [(i * 37 + 11) % 256 for i in range(23)]
NUM_NEW = 12
# The second model: twice the first's width, one more layer, half its context, its own weights.
BIG = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 8,
       "num_key_value_heads": 4, "num_hidden_layers": 3,
       "max_position_embeddings": 512}  # fmt: skip


@dataclass(frozen=True)
class Models:
    small: Path
    big: Path
    big_adapter: Path  # made on the big model's shapes
    small_adapter: Path


@pytest.fixture(scope="module")
def models(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Models:
    root = tmp_path_factory.mktemp("lora_models")
    big = make_tiny_llama(root / "big", seed=2, **BIG)
    return Models(
        small=tiny_llama_dir,
        big=big,
        big_adapter=make_adapter(big, root / "big_tone", 21, 4, 8.0, ALL),
        small_adapter=make_adapter(tiny_llama_dir, root / "small_tone", 22, 4, 8.0, ALL),
    )


@pytest.fixture
def gateway(models: Models, tmp_path: Path) -> Iterator[Client]:
    config = lora_settings(f"small={models.small},big={models.big}", tmp_path / "lora_models.db",
                           4 * 2**20)  # fmt: skip
    with TestClient(create_app(config)) as client:
        yield client


def _complete(client: Client, auth: dict[str, str], model: str) -> Any:
    body = {"model": model, "prompt": PROMPT, "max_tokens": NUM_NEW, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    return client.post("/v1/completions", json=body, headers=auth)


def _register(client: Client, **body: Any) -> Any:
    return admin(client, "POST", ROUTE, json=body)


def _engine_outputs(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[str, str | None, list[int]]]:
    """What each served model's engine produces from now on: (model, adapter id, token ids)."""
    seen: list[tuple[str, str | None, list[int]]] = []
    for runtime in client.app.state.generation.runtimes:
        generate = runtime.engine.generate

        def spy(request: GenerateRequest, name: str = runtime.name, inner: Any = generate) -> Any:
            async def outputs() -> AsyncIterator[RequestOutput]:
                async for output in inner(request):
                    seen.append((name, request.lora_name, list(output.token_ids)))
                    yield output

            return outputs()

        monkeypatch.setattr(runtime.engine, "generate", spy)
    return seen


def _tokens(
    seen: list[tuple[str, str | None, list[int]]],
) -> dict[tuple[str, str | None], list[int]]:
    by: dict[tuple[str, str | None], list[int]] = {}
    for model, adapter, ids in seen:
        by.setdefault((model, adapter), []).extend(ids)
    return by


def test_an_adapter_runs_on_its_base_model_as_peft_merged_does(
    gateway: Client, models: Models, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = hf_greedy(merged_reference(models.big, models.big_adapter), [PROMPT], NUM_NEW)[0]
    untuned = hf_greedy(load_reference(models.big), [PROMPT], NUM_NEW)[0]
    assert expected != untuned  # the adapter changes the greedy tokens
    _, auth = tenant_key(gateway, "acme")

    made = _register(gateway, name="big-tone", path=str(models.big_adapter), base_model="big")
    assert made.status_code == 201, made.text
    big_tone = made.json()
    assert big_tone["base_model"] == "big"
    # Named by none: the first served model, as adapters registered before base models were.
    small = _register(gateway, name="small-tone", path=str(models.small_adapter))
    assert small.status_code == 201 and small.json()["base_model"] is None

    cards = {c["id"]: c for c in gateway.get("/v1/models", headers=auth).json()["data"]}
    assert list(cards) == ["small", "big", "big-tone", "small-tone"]
    assert (cards["big-tone"]["parent"], cards["small-tone"]["parent"]) == ("big", "small")
    card = gateway.get("/v1/models/big-tone", headers=auth)
    assert card.status_code == 200 and card.json()["parent"] == "big"

    seen = _engine_outputs(gateway, monkeypatch)
    tuned = _complete(gateway, auth, "big-tone")
    assert tuned.status_code == 200, tuned.text
    assert tuned.json()["model"] == "big-tone"
    assert _tokens(seen) == {("big", big_tone["id"]): expected}
    assert _complete(gateway, auth, "small-tone").status_code == 200
    assert [(model, adapter) for model, adapter, _ in seen][-1] == ("small", small.json()["id"])
    # Tokenizing for an adapter reads its base model's context, not the first model's.
    for model, context in (("big-tone", 512), ("small-tone", 1024)):
        counted = gateway.post("/tokenize", json={"model": model, "prompt": "hi"}, headers=auth)
        assert counted.status_code == 200, counted.text
        assert counted.json()["max_model_len"] == context

    listed = {a["name"]: a["base_model"] for a in admin(gateway, "GET", ROUTE).json()}
    assert listed == {"big-tone": "big", "small-tone": None}
    one = admin(gateway, "GET", f"{ROUTE}/{big_tone['id']}").json()
    assert one["base_model"] == "big"


def test_a_base_model_is_checked_and_a_misfit_fails_cleanly(
    gateway: Client, models: Models
) -> None:
    _, auth = tenant_key(gateway, "acme")
    big_folder = str(models.big_adapter)
    assert _register(gateway, name="big-tone", path=big_folder, base_model="big").status_code == 201

    unknown = assert_error(_register(gateway, name="x", path=big_folder, base_model="huge"), 400)
    assert unknown["param"] == "base_model"
    assert "`small`" in unknown["message"] and "`big`" in unknown["message"]
    for bad in ("", "x" * 300, "big\x00"):
        refused = assert_error(_register(gateway, name="x", path=big_folder, base_model=bad), 400)
        assert refused["param"] == "base_model"
    assert_error(_register(gateway, name="x", path=big_folder, base_model=7), 400)
    # The same name on the first model: names are the server's, whatever the base model.
    assert_error(_register(gateway, name="big-tone", path=big_folder, base_model="small"), 409)
    # The big model's adapter on the small model: refused by that engine when a request names
    # it, a 400 naming the adapter's fault, never a 500.
    misfit = _register(gateway, name="misfit", path=big_folder, base_model="small")
    assert misfit.status_code == 201, misfit.text
    refused = assert_error(_complete(gateway, auth, "misfit"), 400, "invalid_adapter")
    assert "do not fit the model" in refused["message"]
    assert _complete(gateway, auth, "big-tone").status_code == 200
    assert [a["name"] for a in admin(gateway, "GET", ROUTE).json()] == ["big-tone", "misfit"]


def test_an_adapter_on_a_model_served_elsewhere_is_not_served_here(
    gateway: Client, models: Models
) -> None:
    tenant_id, auth = tenant_key(gateway, "acme")
    service = gateway.app.state.tenant_domain.lora_adapters
    # Registered by a gateway that serves "elsewhere" (the service checks no served models).
    gateway.blocking_portal.call(
        lambda: service.register(
            "far-tone", str(models.big_adapter), tenant_id, base_model="elsewhere"
        )
    )
    assert "far-tone" not in [
        m["id"] for m in gateway.get("/v1/models", headers=auth).json()["data"]
    ]
    far = assert_error(_complete(gateway, auth, "far-tone"), 404, "model_not_found")
    unknown = assert_error(_complete(gateway, auth, "no-such"), 404, "model_not_found")
    assert far["message"].replace("far-tone", "X") == unknown["message"].replace("no-such", "X")
    assert_error(gateway.get("/v1/models/far-tone", headers=auth), 404, "model_not_found")
    listed = admin(gateway, "GET", ROUTE).json()
    assert [(a["name"], a["base_model"]) for a in listed] == [("far-tone", "elsewhere")]


def test_the_gateway_role_sends_an_adapter_to_its_base_models_engines(
    models: Models, tmp_path: Path
) -> None:
    config = settings(
        role="gateway",
        engine_token="secret",
        model=f"small={models.small},big={models.big}",
        engine_url="small=http://small.test,big=http://big.test",
        database_url=migrated_sqlite(tmp_path / "gateway.db"),
        admin_token=ADMIN_TOKEN,
        usage_spool_path=str(tmp_path / "usage.spool"),
    )
    bodies: list[tuple[str, dict[str, Any]]] = []

    def engine(name: str) -> httpx.MockTransport:
        def answer(request: httpx.Request) -> httpx.Response:
            bodies.append((name, json.loads(request.content)))
            frames = [frame(name, 1), frame("", 1, "stop"), b"data: [DONE]\n\n"]
            return httpx.Response(200, stream=CutStream(frames, clean=True))

        return httpx.MockTransport(answer)

    runtimes = []
    for runtime, remote in remote_runtimes(config):
        tokenizer = runtime.tokenizer
        assert isinstance(tokenizer, Tokenizer)  # a gateway loads the tokenizer alone
        runtime.engine = HttpEngineClient(
            remote.url, "secret", tokenizer, runtime.name, transport=engine(runtime.name)
        )
        runtimes.append(runtime)
    with TestClient(create_app(config, engine=runtimes)) as client:
        _, auth = tenant_key(client, "acme")
        # The folder is on the engines' disks: a gateway checks only the base model.
        folder = "/srv/adapters/big-tone"
        unknown = _register(client, name="big-tone", path=folder, base_model="huge")
        assert assert_error(unknown, 400)["param"] == "base_model"
        made = _register(client, name="big-tone", path=folder, base_model="big")
        assert made.status_code == 201, made.text
        models_listed = client.get("/v1/models", headers=auth).json()["data"]
        assert [(m["id"], m.get("parent")) for m in models_listed][-1] == ("big-tone", "big")
        answer = _complete(client, auth, "big-tone")
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == "big"  # the big model's engine answered
    ((name, body),) = bodies
    assert name == "big" and body["model"] == "big"
    assert (body["atrium_lora_id"], body["atrium_lora_path"]) == (made.json()["id"], folder)
