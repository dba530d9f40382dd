"""Key lifecycle at the gateway: model lists and scopes, expiry, rotation and per-key limits,
and the refusals of the tenants' limits as a client reads them (status, type, code, message,
headers), over the SQL tenancy on SQLite with the scripted engine."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient
from structlog.testing import capture_logs

from tenants import Database, TenantDomain
from tenants.key_policy import KeyRotate, KeySpec
from tenants.schemas import Quotas, TenantCreate
from tests.integration.gateway_fakes import MODEL, make_runtime, settings
from tests.support.postgres import migrate
from web.app import create_app

SPECS = {
    "full": KeySpec(name="full"),
    "other_model": KeySpec(name="other", models=["some-other-model"]),
    "this_model": KeySpec(name="this", models=[MODEL]),
    "usage_only": KeySpec(name="usage", scopes=["usage:read"]),
    "expired": KeySpec(name="expired", expires_at=datetime.now(UTC) - timedelta(seconds=1)),
    "one_rpm": KeySpec(name="slow", requests_per_minute=1),
}
# Tenants of their own, with limits: per minute, and a monthly token budget.
LIMITED = {
    "metered": Quotas(requests_per_minute=2, tokens_per_minute=100),
    "budgeted": Quotas(monthly_token_budget=30),
    "capped": Quotas(requests_per_minute=3, max_prompt_tokens=1),
}
RESET = re.compile(r"(\d+h)?(\d+m)?\d+(\.\d+)?s|\d+ms")  # "59.5s", "6m0s", "120ms"


async def _keys(url: str, spool: Path) -> dict[str, str]:
    db = await Database.connect(url)
    domain = await TenantDomain.open(db, spool_path=spool)
    try:
        tenant = await domain.tenants.create(TenantCreate(name="acme"))
        keys = {}
        for label, spec in SPECS.items():
            keys[label] = (await domain.keys.create_key(tenant.id, spec))[1]
        info, keys["rotated_out"] = await domain.keys.create_key(tenant.id, "rotated")
        _, keys["successor"], _ = await domain.keys.rotate_key(
            info.id, KeyRotate(overlap_seconds=0)
        )
        for name, quotas in LIMITED.items():
            limited = await domain.tenants.create(TenantCreate(name=name, quotas=quotas))
            keys[name] = (await domain.keys.create_key(limited.id, name))[1]
        return keys
    finally:
        await domain.close()


@pytest.fixture
def gateway(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[tuple[TestClient[Any], Any]]:
    url = f"sqlite+aiosqlite:///{tmp_path / 'atrium.db'}"
    asyncio.run(migrate(url))
    keys = asyncio.run(_keys(url, tmp_path / "seed.spool"))
    runtime, _ = make_runtime(tiny_llama_dir)
    config = settings(database_url=url, usage_spool_path=str(tmp_path / "usage.spool"))
    with TestClient(create_app(config, engine=runtime, include_admin=False)) as client:

        def call(label: str, path: str = "/v1/completions", max_tokens: int = 2) -> Any:
            auth = {"Authorization": f"Bearer {keys[label]}"}
            if path == "/v1/models":
                return client.get(path, headers=auth)
            body = {"model": MODEL, "prompt": "keys", "max_tokens": max_tokens}
            return client.post(path, json=body, headers=auth)

        yield client, call


def _error(response: Any, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code
    return str(error["message"])


def test_a_key_calls_only_its_models_and_scopes(gateway: tuple[TestClient[Any], Any]) -> None:
    _, call = gateway
    assert call("full").status_code == 200
    assert call("this_model").status_code == 200
    # A model outside the key's list is answered as if it did not exist (as OpenAI does).
    message = _error(call("other_model"), 404, "model_not_found")
    assert "does not exist or you do not have access" in message
    assert call("other_model", "/v1/models").json()["data"] == []
    assert [m["id"] for m in call("this_model", "/v1/models").json()["data"]] == [MODEL]
    # A read-only key may list models but not generate.
    assert "`inference` scope" in _error(call("usage_only"), 401, "missing_scope")
    chat = call("usage_only", "/v1/chat/completions")
    _error(chat, 401, "missing_scope")
    assert call("usage_only", "/v1/models").status_code == 200


def test_expired_and_rotated_out_keys_are_invalid(gateway: tuple[TestClient[Any], Any]) -> None:
    _, call = gateway
    _error(call("expired"), 401, "invalid_api_key")
    _error(call("rotated_out"), 401, "invalid_api_key")
    assert call("successor").status_code == 200


def test_a_key_limit_refuses_with_429(gateway: tuple[TestClient[Any], Any]) -> None:
    _, call = gateway
    first = call("one_rpm")
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "1"
    assert first.headers["x-ratelimit-remaining-requests"] == "0"
    assert first.headers["x-ratelimit-reset-requests"] == "1m0s"  # a whole minute to refill
    refused = call("one_rpm")
    message = _error(refused, 429, "rate_limit_exceeded")
    assert refused.json()["error"]["type"] == "rate_limit_error"
    # It says whose limit it was (the key's, not the tenant's), what it is and when to retry.
    assert message.startswith("Rate limit reached for requests per minute (RPM) of the API key ")
    assert "limit 1, used 1, requested 1" in message
    retry = int(refused.headers["Retry-After"])
    assert 0 < retry <= 60 and f"Please try again in {retry}s." in message
    assert refused.headers["x-ratelimit-limit-requests"] == "1"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert RESET.fullmatch(refused.headers["x-ratelimit-reset-requests"])
    assert refused.headers["x-request-id"]
    free = call("full")
    assert free.status_code == 200  # the tenant itself has no limit
    assert not any(name.startswith("x-ratelimit-") for name in free.headers)


def test_per_minute_limits_in_headers_and_refusals(gateway: tuple[TestClient[Any], Any]) -> None:
    _, call = gateway
    served = call("metered")
    assert served.status_code == 200, served.text
    need = served.json()["usage"]["prompt_tokens"] + 2
    assert served.headers["x-ratelimit-limit-requests"] == "2"
    assert served.headers["x-ratelimit-remaining-requests"] == "1"
    assert served.headers["x-ratelimit-reset-requests"] == "30s"  # one of two, 2 a minute
    assert served.headers["x-ratelimit-limit-tokens"] == "100"
    assert served.headers["x-ratelimit-remaining-tokens"] == str(100 - need)
    assert RESET.fullmatch(served.headers["x-ratelimit-reset-tokens"])
    # max_tokens alone above the tokens a minute allows: never admitted, so a 400, not a 429.
    never = call("metered", max_tokens=150)
    message = _error(never, 400, "tokens_exceed_limit")
    assert never.json()["error"]["type"] == "invalid_request_error"
    assert never.json()["error"]["param"] == "max_tokens"
    assert 'tokens per minute (TPM) limit of the tenant "metered" (100)' in message
    assert "it can never be admitted" in message
    assert "retry-after" not in never.headers
    assert never.headers["x-ratelimit-remaining-requests"] == "1"  # it took nothing
    assert never.headers["x-request-id"]
    assert call("metered").status_code == 200
    refused = call("metered")
    message = _error(refused, 429, "rate_limit_exceeded")
    assert 'requests per minute (RPM) of the tenant "metered": limit 2, used 2' in message
    assert f"Please try again in {refused.headers['Retry-After']}s." in message
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert {"x-ratelimit-limit-tokens", "x-ratelimit-reset-tokens"} <= set(refused.headers)


def test_a_limited_tenants_other_errors_carry_its_limits(
    gateway: tuple[TestClient[Any], Any],
) -> None:
    client, call = gateway
    # Before its first admission at this gateway, its limits (the buckets are in the database).
    too_large = call("capped")
    _error(too_large, 413, "prompt_too_large")
    assert too_large.headers["x-ratelimit-limit-requests"] == "3"
    assert "x-ratelimit-limit-tokens" not in too_large.headers  # it has no tokens limit
    served = call("metered")
    assert served.status_code == 200, served.text
    # After one, where its buckets stood then, refilled since: a 400 of validation too.
    auth = {"Authorization": f"Bearer {served.request.headers['authorization'][7:]}"}
    invalid = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1}, headers=auth
    )
    assert invalid.status_code == 400, invalid.text
    assert invalid.headers["x-ratelimit-limit-requests"] == "2"
    assert invalid.headers["x-ratelimit-remaining-requests"] == "1"
    assert invalid.headers["x-ratelimit-limit-tokens"] == "100"
    reset = float(invalid.headers["x-ratelimit-reset-requests"].removesuffix("s"))
    assert 0 < reset <= 30
    assert int(invalid.headers["x-ratelimit-remaining-tokens"]) >= int(
        served.headers["x-ratelimit-remaining-tokens"]
    )
    unknown = call("metered", "/v1/chat/completions")  # a chat body without messages
    assert unknown.status_code == 400, unknown.text
    assert unknown.headers["x-ratelimit-limit-requests"] == "2"
    # A tenant without per-minute limits gets none, on errors as on answers.
    free = call("full", "/v1/chat/completions")
    assert free.status_code == 400
    assert not any(name.startswith("x-ratelimit-") for name in free.headers)


def test_a_spent_budget_is_insufficient_quota(gateway: tuple[TestClient[Any], Any]) -> None:
    _, call = gateway
    served = call("budgeted")
    assert served.status_code == 200, served.text
    used = served.json()["usage"]["total_tokens"]
    prompt = served.json()["usage"]["prompt_tokens"]
    assert not any(name.startswith("x-ratelimit-") for name in served.headers)  # no rate limits
    # Above the whole budget: never admitted (400); within it but above what is left: 429.
    _error(call("budgeted", max_tokens=31 - prompt), 400, "tokens_exceed_limit")
    with capture_logs() as logs:
        refusals = [call("budgeted", max_tokens=30 - prompt) for _ in range(3)]
    for refused in refusals:
        message = _error(refused, 429, "insufficient_quota")
        assert refused.json()["error"]["type"] == "insufficient_quota"
        assert message.startswith("You exceeded your current quota: the monthly token budget")
        assert 'of the tenant "budgeted" is 30 tokens' in message
        assert f"{30 - used} are left and this request needs up to 30" in message
        resets = re.search(r"resets at (\S+)\.$", message)
        assert resets is not None
        at = datetime.fromisoformat(resets.group(1))
        assert at.tzinfo is not None and at.utcoffset() == timedelta(0)
        assert (at.day, at.hour, at.minute) == (1, 0, 0) and at > datetime.now(UTC)
        # No retry in a month's seconds: clients are told not to retry at all.
        assert "retry-after" not in refused.headers and "retry-after-ms" not in refused.headers
        assert refused.headers["x-should-retry"] == "false"
    lines = [entry for entry in logs if entry["event"] == "request_done"]
    assert [(line["status"], line["reason"]) for line in lines] == [
        (429, "monthly_token_budget")
    ] * 3
    assert [line["request_id"] for line in lines] == [r.headers["x-request-id"] for r in refusals]
