"""LoRA adapters through the gateway on SQLite: registered by the admin for one tenant or all,
named in ``model``, listed per tenant, invisible to other tenants, and metered by name."""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from tests.integration.gateway_fakes import settings
from tests.integration.test_admin_app import ADMIN_TOKEN, assert_error, migrated_sqlite
from tests.support.lora import make_adapter
from web.app import create_app
from web.settings import Settings

Client = TestClient[Litestar]
ROUTE = "/admin/v1/lora-adapters"
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("gateway_adapters")
    return [make_adapter(tiny_llama_dir, root / f"a{i}", 10 + i, 4, 8.0, ALL) for i in range(2)]


@pytest.fixture
def gateway(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[Client]:
    config = lora_settings(str(tiny_llama_dir), tmp_path / "lora.db", 8 * 2**20)
    with TestClient(create_app(config)) as client:
        yield client


def lora_settings(model: str, database: Path, kv_cache_bytes: int) -> Settings:
    """An in-process server of ``model`` (float32, CPU) with two adapter slots of rank 8 and
    the admin API, on a migrated SQLite file at ``database``."""
    return settings(
        model=model,
        dtype="float32",
        device="cpu",
        kv_cache_bytes=kv_cache_bytes,
        database_url=migrated_sqlite(database),
        admin_token=ADMIN_TOKEN,
        engine_process=False,
        target_tpot_ms="off",
        usage_spool_path=str(database.parent / "usage.spool"),
        max_loras=2,
        max_lora_rank=8,
    )


def admin(client: Client, method: str, path: str, **kwargs: Any) -> Any:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    return client.request(method, path, headers=headers, **kwargs)


def tenant_key(client: Client, name: str) -> tuple[str, dict[str, str]]:
    tenant = admin(client, "POST", "/admin/v1/tenants", json={"name": name}).json()
    key = admin(client, "POST", f"/admin/v1/tenants/{tenant['id']}/keys", json={}).json()
    return tenant["id"], {"Authorization": f"Bearer {key['key']}"}


def _complete(client: Client, auth: dict[str, str], model: str) -> Any:
    body = {"model": model, "prompt": "the lighthouse keeper", "max_tokens": 10,
            "temperature": 0}  # fmt: skip
    return client.post("/v1/completions", json=body, headers=auth)


def test_adapters_by_tenant_through_the_api(gateway: Client, adapter_dirs: list[Path]) -> None:
    acme, acme_auth = tenant_key(gateway, "acme")
    _, globex_auth = tenant_key(gateway, "globex")
    base = gateway.get("/v1/models", headers=acme_auth).json()["data"][0]["id"]
    body = {"name": "acme-tone", "path": str(adapter_dirs[0]), "tenant_id": acme}
    own = admin(gateway, "POST", ROUTE, json=body)
    assert own.status_code == 201, own.text
    shared = admin(gateway, "POST", ROUTE, json={"name": "style", "path": str(adapter_dirs[1])})
    assert shared.status_code == 201, shared.text

    acme_models = [m["id"] for m in gateway.get("/v1/models", headers=acme_auth).json()["data"]]
    assert acme_models == [base, "acme-tone", "style"]
    listed = gateway.get("/v1/models", headers=globex_auth).json()["data"]
    assert [m["id"] for m in listed] == [base, "style"]
    assert listed[1]["parent"] == base

    plain = _complete(gateway, acme_auth, base)
    tuned = _complete(gateway, acme_auth, "acme-tone")
    assert plain.status_code == tuned.status_code == 200, tuned.text
    assert tuned.json()["model"] == "acme-tone"
    assert tuned.json()["choices"][0]["text"] != plain.json()["choices"][0]["text"]
    again = _complete(gateway, acme_auth, "acme-tone").json()
    assert again["choices"][0]["text"] == tuned.json()["choices"][0]["text"]
    # The base model's pages of the same prompt never serve the adapter; its own pages do.
    assert tuned.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert _complete(gateway, globex_auth, "style").status_code == 200

    card = gateway.get("/v1/models/acme-tone", headers=acme_auth)
    assert card.status_code == 200 and card.json()["parent"] == base
    assert_error(gateway.get("/v1/models/acme-tone", headers=globex_auth), 404, "model_not_found")
    # Another tenant's adapter is as absent as one that does not exist.
    theirs = assert_error(_complete(gateway, globex_auth, "acme-tone"), 404, "model_not_found")
    unknown = assert_error(_complete(gateway, globex_auth, "no-such"), 404, "model_not_found")
    assert theirs["message"].replace("acme-tone", "X") == unknown["message"].replace("no-such", "X")

    now = datetime.now(UTC)
    window = {
        "start": (now - timedelta(days=1)).isoformat(),
        "end": (now + timedelta(days=1)).isoformat(),
    }
    for _ in range(50):  # the meter writes usage rows shortly after each answer
        export = admin(gateway, "GET", "/admin/v1/billing/export", params=window)
        rows = list(csv.DictReader(io.StringIO(export.text)))
        if sum(int(r["requests"]) for r in rows) == 4:
            break
        time.sleep(0.1)
    by = {(r["tenant_name"], r["model"]): int(r["requests"]) for r in rows}
    assert by, export.text
    assert by == {("acme", base): 1, ("acme", "acme-tone"): 2, ("globex", "style"): 1}


def test_admin_refuses_bad_registrations(
    gateway: Client, adapter_dirs: list[Path], tmp_path: Path
) -> None:
    good = str(adapter_dirs[0])
    assert admin(gateway, "POST", ROUTE, json={"name": "ok", "path": good}).status_code == 201
    assert_error(admin(gateway, "POST", ROUTE, json={"name": "ok", "path": good}), 409)
    assert_error(admin(gateway, "POST", ROUTE, json={"name": "x", "path": str(tmp_path)}), 400)
    assert_error(admin(gateway, "POST", ROUTE, json={"name": "x", "path": "relative/dir"}), 400)
    ghost = {"name": "x", "path": good, "tenant_id": "tn_missing"}
    assert_error(admin(gateway, "POST", ROUTE, json=ghost), 404)
    assert_error(admin(gateway, "POST", ROUTE, json={"name": "bad name", "path": good}), 400)
    assert_error(admin(gateway, "POST", ROUTE, json={"name": "x", "path": good, "x": 1}), 400)
    base = gateway.get("/v1/models", headers=tenant_key(gateway, "t")[1]).json()["data"][0]["id"]
    assert_error(admin(gateway, "POST", ROUTE, json={"name": base, "path": good}), 409)
    listed = admin(gateway, "GET", ROUTE).json()
    assert [a["name"] for a in listed] == ["ok"]
    removed = admin(gateway, "DELETE", f"{ROUTE}/{listed[0]['id']}")
    assert removed.status_code == 200, removed.text
    assert_error(admin(gateway, "DELETE", f"{ROUTE}/{listed[0]['id']}"), 404)
    assert admin(gateway, "GET", ROUTE).json() == []
