"""The Batch API with the official openai client: files, batches, output and error files in
OpenAI's line format, per-line metering at the batch price, the same answers as interactive
requests, cancellation, a restart mid-batch, and quotas (retried) versus the budget (failed)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import openai
import pytest
from sqlalchemy import update

from tenants import Database, TenantDomain
from tenants.billing_render import cost_numerator, round_micros
from tenants.models import BatchRow
from tenants.records import PriceSet
from tests.integration.batch_gateway import (
    FAST,
    batch_events,
    chat_line,
    client,
    file_lines,
    finished,
    gateway,
    jsonl,
    run,
    seed,
    submit,
    wait_for,
)
from tests.integration.gateway_fakes import MODEL, make_runtime, settings
from tests.integration.pg_gateway import migrated_database
from tests.support.postgres import migrate, pg_url

GREEDY = {"temperature": 0, "max_tokens": 4}


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite+aiosqlite:///{tmp_path / 'atrium.db'}"
    run(migrate(url))
    return url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield request.getfixturevalue("sqlite_url")
        return
    with migrated_database() as name:
        yield pg_url(name)


def test_a_batch_on_the_real_engine_matches_interactive_answers_and_is_metered_per_line(
    tiny_llama_dir: Path, sqlite_url: str, tmp_path: Path
) -> None:
    _, key = run(seed(sqlite_url, tmp_path / "seed.spool"))
    config = settings(
        model=str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_bytes=8 * 2**20,
        engine_process=False, database_url=sqlite_url,
        usage_spool_path=str(tmp_path / "usage.spool"), **FAST,
    )  # fmt: skip
    with gateway(config) as http:
        api = client(http, key)
        model = api.models.list().data[0].id
        lines = [chat_line(f"q{n}", model, **GREEDY) for n in range(3)]
        lines.append(chat_line("bad", model, temperature=-1))
        upload = api.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        assert (upload.purpose, upload.bytes, upload.filename) == (
            "batch",
            len(jsonl(lines)),
            "in.jsonl",
        )
        assert api.files.retrieve(upload.id).id == upload.id
        assert api.files.content(upload.id).content == jsonl(lines)
        assert upload.id in [f.id for f in api.files.list()]
        batch = api.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
            metadata={"job": "nightly"},
        )  # fmt: skip
        assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
        done = wait_for(api, batch.id, finished)
        assert done.status == "completed"
        assert done.in_progress_at and done.finalizing_at and done.completed_at
        counts = done.request_counts
        assert (counts.total, counts.completed, counts.failed) == (4, 3, 1)
        assert [b.id for b in api.batches.list()] == [batch.id]
        output = file_lines(api, done.output_file_id)
        errors = file_lines(api, done.error_file_id)
        assert [line["custom_id"] for line in output] == ["q0", "q1", "q2"]
        for line in output:
            assert line["id"].startswith("batch_req_") and line["error"] is None
            assert line["response"]["status_code"] == 200
            # The batch answers exactly as the interactive route does (greedy).
            same = api.chat.completions.create(
                model=model, messages=[{"role": "user", "content": line["custom_id"]}], **GREEDY
            )
            body = line["response"]["body"]
            assert body["object"] == "chat.completion"
            assert body["choices"][0]["message"]["content"] == same.choices[0].message.content
        assert [line["custom_id"] for line in errors] == ["bad"]
        refused = errors[0]["response"]
        assert refused["status_code"] == 400
        assert refused["body"]["error"]["param"] == "temperature"
        events = run(batch_events(sqlite_url, batch.id))
        by_id = {event.request_id: event for event in events}
        assert sorted(by_id) == sorted(line["response"]["request_id"] for line in output)
        for line in output:
            usage = line["response"]["body"]["usage"]
            event = by_id[line["response"]["request_id"]]
            assert (event.prompt_tokens, event.completion_tokens, event.status) == (
                usage["prompt_tokens"], usage["completion_tokens"], "ok",
            )  # fmt: skip
        # The batch object's usage (as OpenAI's) sums its lines' metered tokens.
        usage = api.batches.retrieve(batch.id).usage
        assert usage is not None
        assert usage.input_tokens == sum(e.prompt_tokens for e in events) > 0
        assert usage.input_tokens_details.cached_tokens == sum(e.cached_tokens for e in events)
        assert usage.output_tokens == sum(e.completion_tokens for e in events) > 0
        assert usage.total_tokens == usage.input_tokens + usage.output_tokens
        # Deleting the input file leaves the batch and its outputs alone.
        assert api.files.delete(upload.id).deleted
        with pytest.raises(openai.NotFoundError):
            api.files.retrieve(upload.id)
        assert api.batches.retrieve(batch.id).status == "completed"
        _check_batch_price(sqlite_url, tmp_path, model, events)


def _check_batch_price(url: str, tmp_path: Path, model: str, batch: list[Any]) -> None:
    """The export prices batch lines at the discount and interactive requests in full."""

    async def export() -> tuple[int, list[Any]]:
        db = await Database.connect(url)
        domain = await TenantDomain.open(db, spool_path=tmp_path / "billing.spool")
        try:
            spec = PriceSet(
                input_per_million=3_000_000, cached_input_per_million=300_000,
                output_per_million=15_000_000, effective_from=min(e.started_at for e in batch),
                batch_discount_percent=50,
            )  # fmt: skip
            price = await domain.prices.set_price(model, spec)
            assert (await domain.prices.list_prices())[0].batch_discount_percent == 50
            end = max(e.started_at for e in batch) + timedelta(days=1)
            _, manifest = await domain.billing.billing_export(spec.effective_from, end)  # type: ignore[arg-type]
            async with db.sessions() as session:
                from sqlalchemy import select

                from tenants.models import UsageEventRow

                events = list(await session.scalars(select(UsageEventRow)))
            numerator = sum(
                cost_numerator(price, e.prompt_tokens, e.cached_tokens, e.completion_tokens)
                * (50 if e.batch_id else 100)
                for e in events
            )
            assert any(e.batch_id is None for e in events)  # the interactive ones
            return round_micros(numerator, scale=100), [manifest]
        finally:
            await domain.close()

    expected, (manifest,) = run(export())
    assert manifest.cost_micros == {"USD": expected}


def _scripted(url: str, tmp_path: Path, delay_s: float, **extra: Any) -> Any:
    runtime, engine = make_runtime(Path(extra.pop("model_dir")), delay_s)
    config = settings(
        database_url=url, usage_spool_path=str(tmp_path / f"usage-{id(runtime)}.spool"),
        **FAST, **extra,
    )  # fmt: skip
    return runtime, engine, config


def test_a_batch_survives_a_gateway_restart_running_each_line_once(
    tiny_llama_dir: Path, db_url: str, tmp_path: Path
) -> None:
    _, key = run(seed(db_url, tmp_path / "seed.spool"))
    lines = [chat_line(f"r{n}", MODEL, max_tokens=5) for n in range(10)]
    first = _scripted(db_url, tmp_path, 0.02, model_dir=tiny_llama_dir, batch_max_concurrency=2)
    with gateway(first[2], first[0]) as http:
        api = client(http, key)
        batch = submit(api, lines)
        wait_for(api, batch.id, lambda b: b.request_counts.completed >= 2)
    # Stopped mid-batch: what was in flight went back to pending.
    second = _scripted(db_url, tmp_path, 0.0, model_dir=tiny_llama_dir, batch_max_concurrency=4)
    with gateway(second[2], second[0]) as http:
        api = client(http, key)
        before = api.batches.retrieve(batch.id)
        assert before.status == "in_progress" and before.request_counts.completed < 10
        done = wait_for(api, batch.id, finished)
        assert done.status == "completed"
        output = file_lines(api, done.output_file_id)
    assert sorted(line["custom_id"] for line in output) == sorted(f"r{n}" for n in range(10))
    events = run(batch_events(db_url, batch.id))
    ok = [e for e in events if e.status == "ok"]
    assert sorted(e.request_id for e in ok) == sorted(
        line["response"]["request_id"] for line in output
    )  # one billed answer per line; an attempt cut by the stop is metered as such
    assert all(e.status in ("ok", "disconnect") for e in events)


def test_cancel_stops_a_batch_and_keeps_what_finished(
    tiny_llama_dir: Path, sqlite_url: str, tmp_path: Path
) -> None:
    _, key = run(seed(sqlite_url, tmp_path / "seed.spool"))
    lines = [chat_line(f"c{n}", MODEL, max_tokens=5) for n in range(20)]
    runtime, _, config = _scripted(
        sqlite_url, tmp_path, 0.02, model_dir=tiny_llama_dir, batch_max_concurrency=1
    )
    with gateway(config, runtime) as http:
        api = client(http, key)
        batch = submit(api, lines)
        wait_for(api, batch.id, lambda b: b.request_counts.completed >= 1)
        cancelling = api.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at
        done = wait_for(api, batch.id, finished)
        assert done.status == "cancelled" and done.cancelled_at
        counts = done.request_counts
        assert 1 <= counts.completed < 20 and counts.failed == 0
        assert len(file_lines(api, done.output_file_id)) == counts.completed
        with pytest.raises(openai.ConflictError):
            api.batches.cancel(batch.id)


def test_quota_refusals_wait_and_an_exhausted_budget_fails_lines(
    tiny_llama_dir: Path, sqlite_url: str, tmp_path: Path
) -> None:
    spool = tmp_path / "seed.spool"
    tenant_id, busy = run(seed(sqlite_url, spool, max_concurrent_requests=1))
    runtime, engine, config = _scripted(
        sqlite_url, tmp_path, 0.01, model_dir=tiny_llama_dir, batch_max_concurrency=3
    )
    prompt = runtime.tokenizer.apply_chat_template([{"role": "user", "content": "b0"}])
    budget = 2 * (len(prompt) + 4) + 1  # room for two lines' reservations
    _, thrifty = run(seed(sqlite_url, spool, monthly_token_budget=budget))
    _, spender = run(seed(sqlite_url, spool, monthly_cost_budget=budget))
    run(_price_per_token(sqlite_url, tmp_path))
    with gateway(config, runtime) as http:
        # One request at a time: the other two claims are refused (429) and retried later.
        api = client(http, busy)
        lines = [chat_line(f"q{n}", MODEL, max_tokens=3) for n in range(6)]
        done = wait_for(api, submit(api, lines).id, finished)
        assert (done.status, done.request_counts.completed, done.request_counts.failed) == (
            "completed", 6, 0,
        )  # fmt: skip
        batch_requests = [r for r in engine.requests if r.tenant_id == f"{tenant_id}/batch"]
        assert len(batch_requests) == 6 and all(r.tenant_weight == 0.1 for r in batch_requests)
        # The budget covers two lines; the others fail with a clear line each.
        api = client(http, thrifty)
        lines = [chat_line(f"b{n}", MODEL, max_tokens=4) for n in range(4)]
        done = wait_for(api, submit(api, lines).id, finished)
        assert (done.request_counts.completed, done.request_counts.failed) == (2, 2)
        errors = file_lines(api, done.error_file_id)
        assert {e["response"]["status_code"] for e in errors} == {429}
        assert {e["response"]["body"]["error"]["code"] for e in errors} == {"insufficient_quota"}
        message = errors[0]["response"]["body"]["error"]["message"]
        assert "monthly token budget" in message and "This line was not run." in message
        # A money budget (one micro-unit a token) that covers two lines does the same.
        api = client(http, spender)
        lines = [chat_line(f"b{n}", MODEL, max_tokens=4) for n in range(4)]
        done = wait_for(api, submit(api, lines).id, finished)
        assert (done.request_counts.completed, done.request_counts.failed) == (2, 2)
        errors = file_lines(api, done.error_file_id)
        assert "monthly cost budget" in errors[0]["response"]["body"]["error"]["message"]


async def _price_per_token(url: str, tmp_path: Path) -> None:
    db = await Database.connect(url)
    domain = await TenantDomain.open(db, spool_path=tmp_path / "price.spool")
    try:
        per_token = PriceSet(
            input_per_million=1_000_000, cached_input_per_million=1_000_000,
            output_per_million=1_000_000, effective_from=datetime(2020, 1, 1, tzinfo=UTC),
        )  # fmt: skip
        await domain.prices.set_price(MODEL, per_token)
    finally:
        await domain.close()


def test_bad_uploads_and_batches_are_refused_with_4xx(
    tiny_llama_dir: Path, sqlite_url: str, tmp_path: Path
) -> None:
    _, key = run(seed(sqlite_url, tmp_path / "seed.spool"))
    _, other = run(seed(sqlite_url, tmp_path / "seed.spool", requests_per_minute=1000))
    runtime, _, config = _scripted(
        sqlite_url, tmp_path, 0.0, model_dir=tiny_llama_dir, batch_max_file_bytes=2048
    )
    with gateway(config, runtime) as http:
        api = client(http, key)
        good = jsonl([chat_line("a", MODEL)])
        with pytest.raises(openai.APIStatusError) as info:
            api.files.create(file=("big.jsonl", good * 40), purpose="batch")
        assert info.value.status_code == 413
        with pytest.raises(openai.BadRequestError, match="Line 2"):
            api.files.create(file=("dup.jsonl", good * 2), purpose="batch")
        with pytest.raises(openai.BadRequestError, match="purpose"):
            api.files.create(file=("a.jsonl", good), purpose="fine-tune")
        upload = api.files.create(file=("a.jsonl", good), purpose="batch")
        with pytest.raises(openai.NotFoundError):
            client(http, other).files.retrieve(upload.id)
        with pytest.raises(openai.NotFoundError):
            client(http, other).batches.create(
                input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        with pytest.raises(openai.BadRequestError, match="endpoint"):
            api.batches.create(
                input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
            )
        with pytest.raises(openai.BadRequestError, match="completion_window"):
            api.batches.create(
                input_file_id=upload.id, endpoint="/v1/chat/completions",
                completion_window="1h",  # type: ignore[arg-type]
            )  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            api.batches.retrieve("batch_nope")
        auth = {"Authorization": f"Bearer {key}"}
        raw = http.post("/v1/batches", json={"input_file_id": upload.id, "x": 1}, headers=auth)
        assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
        form = http.post("/v1/files", content=b"{}", headers=auth)
        assert form.status_code == 400
        assert http.get("/v1/files?limit=0", headers=auth).status_code == 400
        assert http.get("/v1/files?order=asc", headers=auth).status_code == 400
        assert [f.id for f in api.files.list(order="desc", limit=1)] == [upload.id]
        assert http.post("/v1/files", headers={}).status_code == 401
        # A line whose model is not served fails the batch at validation.
        bad = api.files.create(file=("m.jsonl", jsonl([chat_line("a", "nope")])), purpose="batch")
        failed = wait_for(api, api.batches.create(
            input_file_id=bad.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id, finished)  # fmt: skip
        assert failed.status == "failed" and failed.errors is not None
        assert failed.errors.data[0].code == "model_not_found" and failed.errors.data[0].line == 1


async def _expire_now(url: str, batch_id: str) -> None:
    db = await Database.connect(url)
    try:
        async with db.transaction() as session:
            await session.execute(
                update(BatchRow)
                .where(BatchRow.id == batch_id)
                .values(expires_at=datetime.now(UTC) - timedelta(seconds=1))
            )
    finally:
        await db.close()


def test_a_batch_past_its_window_expires_with_unrun_lines_in_the_error_file(
    tiny_llama_dir: Path, sqlite_url: str, tmp_path: Path
) -> None:
    _, key = run(seed(sqlite_url, tmp_path / "seed.spool"))
    runtime, _, config = _scripted(
        sqlite_url, tmp_path, 0.02, model_dir=tiny_llama_dir, batch_max_concurrency=1
    )
    with gateway(config, runtime) as http:
        api = client(http, key)
        batch = submit(api, [chat_line(f"e{n}", MODEL, max_tokens=5) for n in range(20)])
        wait_for(api, batch.id, lambda b: b.request_counts.completed >= 1)
        run(_expire_now(sqlite_url, batch.id))
        done = wait_for(api, batch.id, finished)
        assert done.status == "expired" and done.expired_at
        counts = done.request_counts
        assert counts.completed >= 1 and counts.completed + counts.failed == 20
        assert len(file_lines(api, done.output_file_id)) == counts.completed
        errors = file_lines(api, done.error_file_id)
        assert len(errors) == counts.failed
        assert all(e["response"] is None and e["error"]["code"] == "batch_expired" for e in errors)


@pytest.mark.postgres
def test_two_gateways_on_postgres_share_a_batch_and_run_each_line_once(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    with migrated_database() as name:
        url = pg_url(name)
        _, key = run(seed(url, tmp_path / "seed.spool"))
        lines = [chat_line(f"p{n}", MODEL, max_tokens=4) for n in range(16)]
        one = _scripted(url, tmp_path, 0.01, model_dir=tiny_llama_dir, batch_max_concurrency=2)
        two = _scripted(url, tmp_path, 0.01, model_dir=tiny_llama_dir, batch_max_concurrency=2)
        with gateway(one[2], one[0]) as http_one, gateway(two[2], two[0]) as http_two:
            batch = submit(client(http_one, key), lines)
            done = wait_for(client(http_two, key), batch.id, finished)
            output = file_lines(client(http_two, key), done.output_file_id)
        events = run(batch_events(url, batch.id))
    assert done.status == "completed" and done.request_counts.completed == 16
    ran = [{r.request_id.split("-")[1] for r in engine.requests} for engine in (one[1], two[1])]
    assert ran[0] and ran[1]  # both gateways ran lines
    assert not ran[0] & ran[1] and len(ran[0] | ran[1]) == 16  # and never the same one
    assert sorted(line["custom_id"] for line in output) == sorted(f"p{n}" for n in range(16))
    assert len([e for e in events if e.status == "ok"]) == len(events) == 16
