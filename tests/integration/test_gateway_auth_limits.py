"""Guessing keys: failed lookups are limited per client address (429 with Retry-After)."""

from __future__ import annotations

from pathlib import Path

from litestar import Litestar
from litestar.testing import TestClient

from tests.integration.gateway_fakes import KEY_A, MODEL, make_runtime, make_tenancy, settings
from web.app import create_app

Client = TestClient[Litestar]
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def serve(tiny_llama_dir: Path, **overrides: object) -> Client:
    runtime, _ = make_runtime(tiny_llama_dir)
    app = create_app(
        settings(**overrides), engine=runtime, store=make_tenancy(), include_admin=False
    )
    return TestClient(app)


def post(client: Client, key: str) -> int:
    headers = {"Authorization": f"Bearer {key}"}
    return client.post("/v1/completions", json=BODY, headers=headers).status_code


def test_an_address_guessing_keys_is_told_to_wait(tiny_llama_dir: Path) -> None:
    with serve(tiny_llama_dir) as client:
        assert post(client, KEY_A) == 200
        assert [post(client, f"sk-guess-{i}") for i in range(20)] == [401] * 20
        refused = client.post(
            "/v1/completions", json=BODY, headers={"Authorization": "Bearer sk-guess-x"}
        )
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert error["code"] == "too_many_failed_attempts" and error["type"] == "rate_limit_error"
        assert 1 <= int(refused.headers["Retry-After"]) <= 60
        # The address is held up whatever key it sends next, until its failures age out.
        assert post(client, KEY_A) == 429
        assert client.get("/v1/models", headers={"Authorization": "Bearer x"}).status_code == 429


def test_the_limit_is_a_setting_and_zero_turns_it_off(tiny_llama_dir: Path) -> None:
    with serve(tiny_llama_dir, auth_failures_per_minute=2) as client:
        assert [post(client, "sk-a"), post(client, "sk-b"), post(client, "sk-c")] == [401, 401, 429]
    with serve(tiny_llama_dir, auth_failures_per_minute=0) as client:
        assert {post(client, f"sk-{i}") for i in range(30)} == {401}
        assert post(client, KEY_A) == 200
