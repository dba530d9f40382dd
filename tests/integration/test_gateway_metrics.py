"""/metrics: totals without tenant ids by default, tenant labels when asked, an optional token."""

from __future__ import annotations

from pathlib import Path

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from tests.integration.gateway_fakes import KEY_A, MODEL, make_runtime, make_tenancy, settings
from web.app import create_app

Client = TestClient[Litestar]
AUTH = {"Authorization": f"Bearer {KEY_A}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
METRICS_TOKEN = "metrics-scrape-token-123"


def serve(tiny_llama_dir: Path, **overrides: object) -> Client:
    runtime, _ = make_runtime(tiny_llama_dir)
    app = create_app(
        settings(**overrides), engine=runtime, store=make_tenancy(), include_admin=False
    )
    return TestClient(app)


def test_by_default_metrics_are_totals_that_name_no_tenant(tiny_llama_dir: Path) -> None:
    with serve(tiny_llama_dir) as client:
        assert client.post("/v1/chat/completions", json=CHAT, headers=AUTH).status_code == 200
        text = client.get("/metrics").text
    assert "tenant-a" not in text and "tenant=" not in text
    assert "atrium_completion_tokens_total 3.0" in text
    assert 'atrium_requests_total{endpoint="chat",status="ok"} 1.0' in text
    assert "atrium_time_to_first_token_seconds_count 1.0" in text


def test_tenant_labels_when_configured(tiny_llama_dir: Path) -> None:
    with serve(tiny_llama_dir, metrics_tenant_labels=True) as client:
        assert client.post("/v1/chat/completions", json=CHAT, headers=AUTH).status_code == 200
        text = client.get("/metrics").text
    assert 'atrium_completion_tokens_total{tenant="tenant-a"} 3.0' in text
    assert 'atrium_requests_total{endpoint="chat",status="ok",tenant="tenant-a"} 1.0' in text


@pytest.mark.parametrize(
    "header",
    [
        None,
        "Bearer wrong",
        f"Basic {METRICS_TOKEN}",
        "Bearer ",
        "Bearer \xe9t\xe9".encode("latin-1"),
    ],
)
def test_a_metrics_token_keeps_anonymous_scrapers_out(
    tiny_llama_dir: Path, header: str | bytes | None
) -> None:
    with serve(tiny_llama_dir, metrics_token=METRICS_TOKEN) as client:
        headers = {} if header is None else {"Authorization": header}
        response = client.get("/metrics", headers=headers)  # type: ignore[arg-type]
        assert response.status_code == 401, response.text
        error = response.json()["error"]
        assert error["code"] == "invalid_metrics_token" and error["type"] == "authentication_error"
        assert response.headers["www-authenticate"] == "Bearer"
        good = client.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
        assert good.status_code == 200 and "atrium_requests_in_flight" in good.text
        assert client.get("/healthz").status_code == 200  # probes stay open
        assert client.get("/readyz").status_code == 200


def test_the_settings_come_from_the_environment() -> None:
    from web.settings import Settings

    loaded = Settings.load(
        environ={"ATRIUM_METRICS_TOKEN": "t0k", "ATRIUM_METRICS_TENANT_LABELS": "true"}
    )
    assert loaded.metrics_token == "t0k" and loaded.metrics_tenant_labels is True
    assert Settings.load(environ={}).metrics_tenant_labels is False
