"""Usage that can be neither stored nor spooled: the gateway says it is not ready and stops
admitting paid work (503 with Retry-After) until the disk takes the held events again."""

from __future__ import annotations

import asyncio
import errno
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from tenants.records import UsageEvent
from tenants.schemas import Quotas
from tenants.spool import Spool
from tenants.usage_store import UsageStore, insert_events
from tests.integration.gateway_fakes import MODEL, make_runtime, settings
from tests.integration.pg_gateway import create_tenant, read_books
from tests.support.postgres import migrate
from web.app import create_app

PROMPT = {"model": MODEL, "prompt": "usage", "max_tokens": 2}


class Faults:
    """Switches for a database that refuses usage rows and a disk that refuses the spool."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.database_down = False
        self.disk_full = False
        self.disk_errno = errno.ENOSPC  # or EROFS: the spool's file system went read-only
        write, append = UsageStore.write, Spool.append

        async def failing_write(store: UsageStore, events: Sequence[UsageEvent]) -> int:
            if self.database_down:
                raise ConnectionError("database unreachable")
            return await write(store, events)

        def failing_append(spool: Spool, events: Sequence[UsageEvent]) -> None:
            if self.disk_full:
                raise OSError(self.disk_errno, os.strerror(self.disk_errno))
            append(spool, events)

        async def failing_insert(db: Any, session: Any, events: Sequence[UsageEvent]) -> Any:
            if self.database_down:
                raise RuntimeError("usage rows refused")
            return await insert_events(db, session, events)

        monkeypatch.setattr(UsageStore, "write", failing_write)
        monkeypatch.setattr("tenants.admission.insert_events", failing_insert)  # with a settle
        monkeypatch.setattr(Spool, "append", failing_append)


def _wait_for(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def gateway(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[TestClient[Any], dict[str, str], Faults]]:
    url = f"sqlite+aiosqlite:///{tmp_path / 'atrium.db'}"
    asyncio.run(migrate(url))
    (key,) = asyncio.run(create_tenant(url, tmp_path / "seed.spool", "spool", Quotas(), 1))
    runtime, _ = make_runtime(tiny_llama_dir)
    config = settings(database_url=url, usage_spool_path=str(tmp_path / "usage.spool"))
    faults = Faults(monkeypatch)
    with TestClient(create_app(config, engine=runtime, include_admin=False)) as client:
        yield client, {"Authorization": f"Bearer {key}"}, faults


@pytest.mark.parametrize("disk_errno", [errno.ENOSPC, errno.EROFS], ids=["full", "read_only"])
def test_a_failing_spool_stops_paid_work_until_the_disk_recovers(
    gateway: tuple[TestClient[Any], dict[str, str], Faults], disk_errno: int
) -> None:
    client, auth, faults = gateway
    faults.disk_errno = disk_errno
    assert client.post("/v1/completions", json=PROMPT, headers=auth).status_code == 200
    assert client.get("/readyz").status_code == 200

    faults.database_down = faults.disk_full = True
    assert client.post("/v1/completions", json=PROMPT, headers=auth).status_code == 200
    _wait_for(lambda: client.get("/readyz").status_code == 503)
    ready = client.get("/readyz").json()
    assert ready["usage_durable"] is False and ready["database"] is True
    refused = client.post("/v1/completions", json=PROMPT, headers=auth)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "usage_unavailable"
    assert int(refused.headers["Retry-After"]) >= 1

    faults.disk_full = False  # the held event goes to the spool at the meter's next retry
    meter = client.app.state.tenant_domain.meter
    client.blocking_portal.call(meter.flush)
    assert meter.spooled and client.get("/readyz").status_code == 200
    assert client.post("/v1/completions", json=PROMPT, headers=auth).status_code == 200
    faults.database_down = False
    client.blocking_portal.call(meter.flush)
    assert not meter.spooled and meter.held == 0
    books = asyncio.run(read_books(client.app.state.settings.database_url))
    assert len(books.request_ids) == 3  # every request served is stored, once
    assert len(set(books.request_ids)) == 3
    assert (books.budget_reserved, books.reservations, books.in_flight) == (0, 0, 0)
