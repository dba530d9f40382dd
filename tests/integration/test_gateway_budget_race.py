"""Two `atrium serve` processes on one PostgreSQL, 64 concurrent requests, a small token budget.

Admission reserves prompt + max_tokens atomically in SQL, so however the requests interleave
across the processes, what is used and reserved never exceeds the budget; the rest get 429.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import asyncpg
import httpx
import pytest

from tenants import Database, TenantDomain
from tenants.schemas import Quotas, QuotasPatch, TenantPatch
from tests.integration.pg_gateway import (
    ADMIN_TOKEN,
    create_tenant,
    migrated_database,
    read_books,
)
from tests.support.postgres import PG_ADMIN_DSN, pg_url

pytestmark = [pytest.mark.postgres, pytest.mark.slow]
ATRIUM = [sys.executable, "-c", "from web.cli import main; raise SystemExit(main())"]
SLOTS = 10  # requests the budget has room for
MAX_TOKENS = 8
PER_PROCESS = 32


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def _serve(
    model: Path, url: str, tmp: Path, name: str
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """One gateway process; yields its base URL and the process."""
    port = _free_port()
    env = {
        **os.environ,
        "ATRIUM_ADMIN_TOKEN": ADMIN_TOKEN,
        "ATRIUM_USAGE_SPOOL_PATH": str(tmp / f"{name}.spool"),
        "ATRIUM_KV_CACHE_BYTES": str(8 * 2**20),
    }
    args = ["serve", "--port", str(port), "--model", str(model), "--dtype", "float32"]
    args += ["--device", "cpu", "--database-url", url]
    log_path = tmp / f"{name}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([*ATRIUM, *args], env=env, stdout=log, stderr=log)
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(servers: list[tuple[str, subprocess.Popen[bytes]]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = dict(servers)
    while pending:
        assert time.monotonic() < deadline, f"not ready: {sorted(pending)}"
        for base, proc in list(pending.items()):
            assert proc.poll() is None, f"{base} exited with {proc.returncode} (see its log)"
            try:
                if httpx.get(base + "/readyz", timeout=2).status_code == 200:
                    del pending[base]
            except httpx.HTTPError:
                pass
        time.sleep(0.25)


async def _set_budget(url: str, tmp: Path, tenant_name: str, budget: int) -> None:
    db = await Database.connect(url)
    domain = await TenantDomain.open(db, spool_path=tmp / "admin.spool")
    try:
        tenant = next(t for t in await domain.tenants.list_tenants() if t.name == tenant_name)
        patch = TenantPatch(quotas=QuotasPatch(monthly_token_budget=budget))
        await domain.tenants.update(tenant.id, patch)
    finally:
        await domain.close()


async def _race(
    bases: list[str], key: str, model: str, dsn: str
) -> tuple[list[httpx.Response], int]:
    """64 requests at once, half to each process, while sampling used + reserved in SQL."""
    body = {"model": model, "prompt": "race to the budget", "max_tokens": MAX_TOKENS, "seed": 3}
    headers = {"Authorization": f"Bearer {key}"}
    conn = await asyncpg.connect(dsn, timeout=3)
    peak = 0
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            spent = await conn.fetchval(
                "SELECT COALESCE(SUM(used + reserved), 0) FROM token_budgets"
            )
            peak = max(peak, int(spent))
            await asyncio.sleep(0.005)

    limits = httpx.Limits(max_connections=PER_PROCESS)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        sampler = asyncio.create_task(sample())
        calls = [
            client.post(f"{base}/v1/completions", json=body, headers=headers)
            for base in bases
            for _ in range(PER_PROCESS)
        ]
        responses = await asyncio.gather(*calls)
        done.set()
        await sampler
    await conn.close()
    return list(responses), peak


def test_two_gateways_never_overspend_a_small_budget(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with migrated_database() as name, ExitStack() as stack:
        url = pg_url(name)
        (key,) = asyncio.run(create_tenant(url, tmp_path / "seed.spool", "race", Quotas(), 1))
        servers = [
            stack.enter_context(_serve(tiny_llama_dir, url, tmp_path, f"gw{n}")) for n in (0, 1)
        ]
        # Both processes may build the native kernels at once on a cold cache (two cores).
        _wait_ready(servers, timeout_s=180)
        bases = [base for base, _ in servers]
        headers = {"Authorization": f"Bearer {key}"}
        model = httpx.get(bases[0] + "/v1/models", headers=headers).json()["data"][0]["id"]
        warmup = [
            httpx.post(
                f"{base}/v1/completions",
                json={"model": model, "prompt": "race to the budget", "max_tokens": MAX_TOKENS},
                headers=headers,
                timeout=60,
            )
            for base in bases
        ]
        assert [r.status_code for r in warmup] == [200, 200]
        prompt_tokens = warmup[0].json()["usage"]["prompt_tokens"]
        spent_before = sum(r.json()["usage"]["total_tokens"] for r in warmup)
        need = prompt_tokens + MAX_TOKENS
        budget = spent_before + SLOTS * need
        asyncio.run(_set_budget(url, tmp_path, "race", budget))

        dsn = PG_ADMIN_DSN.rsplit("/", 1)[0] + f"/{name}"
        responses, peak = asyncio.run(_race(bases, key, model, dsn))

        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {200, 429}, statuses
        admitted = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code == 429]
        # Every slot that fits is granted (refunds of unused max_tokens may fit a few more).
        assert SLOTS <= len(admitted) < len(responses)
        for response in refused:
            # The budget is spent until the month ends: nothing to retry sooner.
            assert "Retry-After" not in response.headers
            assert response.headers["x-should-retry"] == "false"
            assert response.json()["error"]["code"] == "insufficient_quota"
        assert peak <= budget  # reserved + used never exceeded the budget, at any sample

        def settled() -> bool:
            return asyncio.run(read_books(url)).reservations == 0

        deadline = time.monotonic() + 20
        while not settled():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        books = asyncio.run(read_books(url))
        served = sum(r.json()["usage"]["total_tokens"] for r in admitted)
        assert books.budget_reserved == 0
        assert books.budget_used == spent_before + served <= budget
