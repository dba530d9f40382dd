"""Tracing, logs and refusal metrics at the gateway: a caller's `traceparent` parents the
request's span; a request logs one line; refusals are counted by status and reason; the engine's
preemptions, drafts and per-tenant gauges reach /metrics (tenant gauges only with tenant labels
on)."""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path
from typing import Any

from litestar import Litestar
from litestar.testing import TestClient
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from structlog.testing import capture_logs

from engine.stats import EngineSnapshot, EngineStats
from radix_cache.stats import NamespaceSnapshot
from tests.integration.gateway_fakes import (
    KEY_A,
    KEY_B,
    KEY_SUSPENDED,
    MODEL,
    make_runtime,
    make_tenancy,
    settings,
)
from web.app import create_app
from web.engine_api.local import engine_numbers

Client = TestClient[Litestar]
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def _serve(
    tiny_llama_dir: Path, exporter: InMemorySpanExporter | None = None, **overrides: object
) -> Client:
    runtime, _ = make_runtime(tiny_llama_dir)
    processor = None if exporter is None else SimpleSpanProcessor(exporter)
    app = create_app(
        settings(**overrides),
        engine=runtime,
        store=make_tenancy(),
        include_admin=False,
        span_processor=processor,
    )
    return TestClient(app)


def _chat(client: Client, key: str, **headers: str) -> Any:
    return client.post(
        "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}", **headers}
    )


def test_a_traceparent_makes_the_request_span_its_child(tiny_llama_dir: Path) -> None:
    exporter = InMemorySpanExporter()
    with _serve(tiny_llama_dir, exporter) as client:
        traceparent = f"00-{TRACE_ID}-{PARENT_ID}-01"
        assert _chat(client, KEY_A, traceparent=traceparent).status_code == 200
        assert _chat(client, KEY_A, traceparent="00-not-a-valid-header").status_code == 200
    roots = [s for s in exporter.get_finished_spans() if s.name == "generate chat"]
    assert len(roots) == 2
    joined, fresh = roots
    assert format(joined.context.trace_id, "032x") == TRACE_ID
    assert joined.parent is not None and format(joined.parent.span_id, "016x") == PARENT_ID
    assert joined.parent.is_remote
    # A malformed header is ignored: that request starts its own trace.
    assert fresh.parent is None and format(fresh.context.trace_id, "032x") != TRACE_ID
    phases = [s for s in exporter.get_finished_spans() if s.name in ("queue", "decode")]
    assert {s.context.trace_id for s in phases} == {r.context.trace_id for r in roots}


def test_refusals_are_counted_by_status_and_reason(tiny_llama_dir: Path) -> None:
    with _serve(tiny_llama_dir) as client:
        assert _chat(client, "sk-unknown").status_code == 401
        assert _chat(client, "sk-unknown").status_code == 401
        assert _chat(client, KEY_SUSPENDED).status_code == 403
        assert _chat(client, KEY_B).status_code == 429  # no concurrent request allowed
        assert _chat(client, KEY_A).status_code == 200
        client.app.state.generation.draining = True
        assert _chat(client, KEY_A).status_code == 503
        text = client.get("/metrics").text
    assert 'atrium_refusals_total{reason="invalid_api_key",status="401"} 2.0' in text
    assert 'atrium_refusals_total{reason="tenant_suspended",status="403"} 1.0' in text
    assert 'atrium_refusals_total{reason="concurrency",status="429"} 1.0' in text
    assert 'atrium_refusals_total{reason="draining",status="503"} 1.0' in text
    assert "tenant-" not in text  # refusals never name a tenant


def _snapshot(preemptions: int, running: dict[str, int]) -> EngineSnapshot:
    def cached(namespace: str, pages: int) -> NamespaceSnapshot:
        return NamespaceSnapshot(
            namespace=namespace,
            resident_pages=pages,
            locked_pages=0,
            share=None,
            weight=1.0,
            cap_pages=None,
            queries=0,
            queried_tokens=0,
            hit_tokens=0,
            public_hit_tokens=0,
            evicted_pages=0,
        )

    return EngineSnapshot(
        running_by_tenant=running,
        waiting_by_tenant={"tenant-a": 2},
        queue_wait_by_tenant={"tenant-a": 1.5},
        num_pages_total=64,
        num_pages_free=40,
        num_pages_available=50,
        page_size=16,
        counters=dataclasses.replace(
            EngineStats(),
            num_preemptions=preemptions,
            num_draft_tokens=40,
            num_accepted_draft_tokens=30,
        ),
        cache_by_namespace={
            "tenant:tenant-a": cached("tenant:tenant-a", 5),
            "tenant:tenant-a/lora:sql": cached("tenant:tenant-a/lora:sql", 3),
            "public": cached("public", 7),
        },
    )


def _with_engine(client: Client, snapshots: list[EngineSnapshot]) -> list[str]:
    """/metrics after each snapshot in turn, as the engine would report them."""
    texts = []
    for snapshot in snapshots:
        runtime = client.app.state.generation.runtime
        client.app.state.generation.runtime = dataclasses.replace(
            runtime, stats=lambda s=snapshot: engine_numbers(s)
        )
        texts.append(client.get("/metrics").text)
    return texts


def test_engine_counters_and_per_tenant_gauges(tiny_llama_dir: Path) -> None:
    with _serve(tiny_llama_dir, metrics_tenant_labels=True) as client:
        first, second = _with_engine(
            client,
            [_snapshot(3, {"tenant-a": 1, "tenant-b": 4}), _snapshot(5, {"tenant-a": 1})],
        )
    assert "atrium_engine_preemptions_total 3.0" in first
    assert "atrium_engine_preemptions_total 5.0" in second  # the engine's total, not a sum
    assert "atrium_draft_tokens_total 40.0" in second
    assert "atrium_draft_tokens_accepted_total 30.0" in second
    assert 'atrium_tenant_queue_depth{tenant="tenant-a"} 2.0' in first
    assert 'atrium_tenant_queue_wait_seconds{tenant="tenant-a"} 1.5' in first
    assert 'atrium_tenant_running_requests{tenant="tenant-b"} 4.0' in first
    assert 'atrium_tenant_kv_pages{tenant="tenant-a"} 8.0' in first  # its own and its adapter's
    assert 'tenant="tenant-b"' not in second  # gone once it has nothing in the engine
    assert 'tenant="public"' not in first


def test_without_tenant_labels_no_tenant_gauge(tiny_llama_dir: Path) -> None:
    with _serve(tiny_llama_dir) as client:
        [text] = _with_engine(client, [_snapshot(1, {"tenant-a": 1})])
    assert "atrium_engine_preemptions_total 1.0" in text
    assert "atrium_tenant_" not in text and "tenant-a" not in text


def test_a_span_per_prefill_chunk_and_decode_step(tiny_llama_dir: Path) -> None:
    exporter = InMemorySpanExporter()
    config = settings(
        model=str(tiny_llama_dir),
        dtype="float32",
        device="cpu",
        kv_cache_bytes=8 * 2**20,
        engine_process=False,
        max_num_batched_tokens=16,  # a 40-token prompt takes three chunks
        max_num_seqs=4,
        target_tpot_ms="off",
    )
    processor = SimpleSpanProcessor(exporter)
    app = create_app(config, store=make_tenancy(), include_admin=False, span_processor=processor)
    with TestClient(app) as client:
        auth = {"Authorization": f"Bearer {KEY_A}"}
        model = client.get("/v1/models", headers=auth).json()["data"][0]["id"]
        body = {"model": model, "prompt": list(range(1, 41)), "max_tokens": 3, "temperature": 0}
        with capture_logs() as logs:
            response = client.post("/v1/completions", json=body, headers=auth)
        assert response.status_code == 200
    # One line for the request, the gateway's; the engine's own view of it is a debug line.
    [done] = [entry for entry in logs if entry["event"] == "request_done"]
    assert (done["request_id"], done["log_level"]) == (response.headers["x-request-id"], "info")
    assert (done["prompt_tokens"], done["completion_tokens"]) == (40, 3)
    [engine_line] = [entry for entry in logs if entry["event"] == "engine_request_finished"]
    assert engine_line["log_level"] == "debug" and engine_line["num_output_tokens"] == 3
    assert not [entry for entry in logs if entry["event"] == "request_finished"]
    spans = exporter.get_finished_spans()
    [root] = [s for s in spans if s.name == "generate completion"]
    steps = sorted(
        (s for s in spans if s.name.startswith("engine ")), key=lambda s: s.start_time or 0
    )
    assert [s.name for s in steps] == ["engine prefill"] * 3 + ["engine decode"] * 2
    assert all(s.parent is not None and s.parent.span_id == root.context.span_id for s in steps)
    attributes = [dict(s.attributes or {}) for s in steps]
    assert [a["atrium.step.tokens"] for a in attributes[:3]] == [16, 16, 8]
    assert {a["atrium.step.batch_size"] for a in attributes} == {1}
    assert root.start_time is not None and root.end_time is not None
    assert all(
        root.start_time <= (s.start_time or 0) <= (s.end_time or 0) <= root.end_time for s in steps
    )


def test_engine_steps_are_not_traced_without_an_exporter(tiny_llama_dir: Path) -> None:
    with _serve(tiny_llama_dir) as client:
        assert client.app.state.generation.trace_steps is False
    with _serve(tiny_llama_dir, InMemorySpanExporter()) as client:
        assert client.app.state.generation.trace_steps is True


def test_start_up_objects_are_frozen_while_the_gateway_serves(tiny_llama_dir: Path) -> None:
    # A full collection walking them paused every request for 0.15-0.36 s on two cores.
    assert gc.get_freeze_count() == 0
    with _serve(tiny_llama_dir) as client:
        assert gc.get_freeze_count() > 1000
        assert _chat(client, KEY_A).status_code == 200
    assert gc.get_freeze_count() == 0  # a stopped gateway's objects are collectable again
