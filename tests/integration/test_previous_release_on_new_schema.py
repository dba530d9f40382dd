"""The previous release runs on this release's schema: migrations expand first and contract a
release later, so a rollback finds a database its code can use (decision 44).

The previous release's code is taken from the repository's own history (the commit just before
the head migration was added; the checkout's commit while that migration is not committed yet).
A PostgreSQL database is migrated to the head by this code, then that code's `atrium db check`
(the gateways' init container) must accept it and its gateway must admit, serve and meter an
authenticated request on it. SQLite is left out: releases before migration 0012 upgrade the
embedded database at start and stop at a revision they do not know."""

from __future__ import annotations

import asyncio
import io
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx
import pytest
from alembic.script import ScriptDirectory

from tenants.database import script_location
from tenants.schema_version import compatible_from
from tenants.schemas import Quotas
from tests.integration.gateway_fakes import MODEL
from tests.integration.gateway_process import ROOT, started_gateway
from tests.integration.pg_gateway import create_tenant, migrated_database, read_books
from tests.support.postgres import pg_url

pytestmark = [pytest.mark.slow, pytest.mark.postgres]
# What a gateway's code needs, and the test helpers its crash worker imports.
TREES = ("atrium_errors", "engine", "radix_cache", "tenants", "web", "migrations", "tests")
ATRIUM = [sys.executable, "-c", "from web.cli import main; raise SystemExit(main())"]
REQUEST = {"model": MODEL, "prompt": "hello there", "max_tokens": 5}


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"needs the repository's git history (git {args[0]}: {done.stderr.strip()})")
    return done.stdout.strip()


def previous_release() -> tuple[str, str]:
    """The commit of the previous release's code and the revision it has as its head: the code
    just before the migration that follows the oldest revision the head still runs with."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the repository's git history (no git checkout here)")
    scripts = ScriptDirectory(str(script_location()))
    script = scripts.get_revision(scripts.get_current_head())
    assert script is not None
    oldest = compatible_from(script)
    if oldest == script.revision:
        pytest.skip(f"migration {oldest} is a contract step: no earlier release runs on it")
    while script.down_revision != oldest:
        script = scripts.get_revision(script.down_revision)
        assert script is not None, f"{oldest} is not an ancestor of the head"
    path = Path(script.path).resolve().relative_to(ROOT).as_posix()
    added = _git("log", "--diff-filter=A", "--format=%H", "-1", "--", path)
    commit = _git("rev-parse", "--verify", f"{added}^" if added else "HEAD")
    return commit, oldest


def checkout(commit: str, into: Path) -> Path:
    archive = subprocess.run(
        ["git", "archive", "--format=tar", commit, *TREES],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
        check=True,
    )
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


def test_the_previous_releases_gateway_serves_and_meters_on_the_new_schema(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    commit, old_head = previous_release()
    old = checkout(commit, tmp_path / "previous")
    shipped = ScriptDirectory(str(old / "migrations")).get_current_head()
    assert shipped == old_head, (commit, shipped, old_head)
    head = ScriptDirectory(str(script_location())).get_current_head()
    env = {"PYTHONPATH": str(old), "PATH": "/usr/bin:/bin"}

    with migrated_database() as name:  # at this code's head
        url = pg_url(name)
        quotas = Quotas(max_concurrent_requests=1, monthly_token_budget=100_000)
        (key,) = asyncio.run(create_tenant(url, tmp_path / "seed.spool", "old", quotas, 1))

        check = subprocess.run(
            [*ATRIUM, "db", "check", "--database-url", url],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert check.returncode == 0, check.stderr
        assert check.stdout.startswith(f"{head} (newer than this code's {old_head}"), check.stdout

        with started_gateway(tiny_llama_dir, url, tmp_path, "previous", root=old) as (base, _):
            auth = {"Authorization": f"Bearer {key}"}
            answer = httpx.post(base + "/v1/completions", json=REQUEST, headers=auth, timeout=30)
            assert answer.status_code == 200, answer.text
            usage = answer.json()["usage"]
            assert usage["completion_tokens"] > 0
            request_id = answer.headers["x-request-id"]
            deadline = time.monotonic() + 10
            while request_id not in (books := asyncio.run(read_books(url))).request_ids:
                assert time.monotonic() < deadline, "the request was never metered"
                time.sleep(0.05)
            # Settled to what it used: no reservation, no slot held, nothing left reserved.
            assert books.budget_used == usage["total_tokens"]
            assert (books.budget_reserved, books.reservations, books.in_flight) == (0, 0, 0)
