"""A gateway on a tenant database for Batch API tests: tenants, the official client, waits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import openai
from litestar.testing import TestClient
from sqlalchemy import select

from tenants import Database, TenantDomain
from tenants.models import UsageEventRow
from tenants.schemas import Quotas, TenantCreate
from web.app import create_app
from web.openai.generation import ModelRuntime
from web.settings import Settings

FAST = {"batch_poll_s": 0.05, "gateway_lease_s": 3.0}


async def seed(url: str, spool: Path, **quotas: Any) -> tuple[str, str]:
    """A tenant named after its quotas, with one key: (tenant id, secret)."""
    db = await Database.connect(url)
    domain = await TenantDomain.open(db, spool_path=spool)
    try:
        name = "t-" + "-".join(f"{k}{v}" for k, v in sorted(quotas.items())) or "plain"
        tenant = await domain.tenants.create(TenantCreate(name=name, quotas=Quotas(**quotas)))
        _, secret = await domain.keys.create_key(tenant.id)
        return tenant.id, secret
    finally:
        await domain.close()


async def batch_events(url: str, batch_id: str) -> list[UsageEventRow]:
    db = await Database.connect(url)
    try:
        async with db.sessions() as session:
            stmt = select(UsageEventRow).where(UsageEventRow.batch_id == batch_id)
            return list(await session.scalars(stmt))
    finally:
        await db.close()


@contextmanager
def gateway(settings: Settings, runtime: ModelRuntime | None = None) -> Iterator[TestClient[Any]]:
    with TestClient(create_app(settings, engine=runtime, include_admin=False)) as http:
        yield http


def client(http: TestClient[Any], key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0
    )


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(msgspec.json.encode(line) + b"\n" for line in lines)


def chat_line(custom_id: str, model: str, **body: Any) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": custom_id}], **body}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def submit(api: openai.OpenAI, lines: list[dict[str, Any]]) -> Any:
    upload = api.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return api.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def wait_for(api: openai.OpenAI, batch_id: str, done: Any, timeout_s: float = 60.0) -> Any:
    """The batch once ``done(batch)`` holds (checked every 20 ms)."""
    deadline = time.monotonic() + timeout_s
    while True:
        batch = api.batches.retrieve(batch_id)
        if done(batch):
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch stuck: {batch}")
        time.sleep(0.02)


def finished(batch: Any) -> bool:
    return batch.status in ("completed", "failed", "expired", "cancelled")


def file_lines(api: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    data = api.files.content(file_id).content
    return [msgspec.json.decode(line) for line in data.splitlines()]


def run(coro: Any) -> Any:
    return asyncio.run(coro)
