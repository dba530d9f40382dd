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
    assert f'vllm:time_to_first_token_seconds_count{{model_name="{MODEL}"}} 1.0' in text


LATENCIES = (
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
)


def _count(text: str, family: str, labels: str) -> float:
    """A histogram's sample count for one label set (0 when the series does not exist)."""
    prefix = f"{family}_count{{{labels}}} "
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    return float(lines[0][len(prefix) :]) if lines else 0.0


def test_request_latency_histograms_under_vllms_names(tiny_llama_dir: Path) -> None:
    labels = f'model_name="{MODEL}"'
    with serve(tiny_llama_dir) as client:
        before = client.get("/metrics")
        assert client.post("/v1/chat/completions", json=CHAT, headers=AUTH).status_code == 200
        after = client.get("/metrics").text
    for family in LATENCIES:
        assert f"# TYPE {family} histogram" in before.text
        assert _count(before.text, family, labels) == 0.0
    assert _count(after, "vllm:e2e_request_latency_seconds", labels) == 1.0
    assert _count(after, "vllm:request_queue_time_seconds", labels) == 1.0
    assert _count(after, "vllm:time_to_first_token_seconds", labels) == 1.0
    assert _count(after, "vllm:inter_token_latency_seconds", labels) == 2.0  # 3 tokens, 2 gaps
    # One name per measure: the gateway's own TTFT and ITL histograms went to vLLM's names.
    assert "atrium_time_to_first_token" not in after and "atrium_inter_token" not in after
    # The exposition format's media type, with its charset once.
    content_type = before.headers["content-type"]
    assert content_type.startswith("text/plain; version=")
    assert content_type.count("charset") == 1 and content_type.endswith("charset=utf-8")


def test_latency_histograms_carry_the_tenant_when_labels_are_on(tiny_llama_dir: Path) -> None:
    with serve(tiny_llama_dir, metrics_tenant_labels=True) as client:
        assert client.post("/v1/chat/completions", json=CHAT, headers=AUTH).status_code == 200
        text = client.get("/metrics").text
    labels = f'model_name="{MODEL}",tenant="tenant-a"'
    assert all(_count(text, family, labels) >= 1.0 for family in LATENCIES)


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
