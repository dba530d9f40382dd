"""The engine role's ``vllm:lora_requests_info``: while adapter requests run and wait, its labels
name their adapters (as the gateway sent them), and once they end it names none; its value is
the time of the engine's latest snapshot, as vLLM sets it to the time of its last update."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.gateway_fakes import settings
from tests.support.lora import make_adapter
from web.engine_api import create_engine_app

Client = TestClient[Litestar]
TOKEN = "engine-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LORA_INFO = "vllm:lora_requests_info"
NUM_NEW = 400  # long enough to be seen running across several snapshots (every 0.1 s)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[Client]:
    config = settings(
        model=str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_bytes=8 * 2**20,
        role="engine", engine_token=TOKEN, max_num_seqs=1, max_loras=2, max_lora_rank=8,
    )  # fmt: skip
    with TestClient(create_engine_app(config)) as client:
        yield client


def _lora_info(client: Client) -> tuple[dict[str, str], float]:
    text = client.get("/metrics", headers=AUTH).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (sample,) = families[LORA_INFO].samples
    return sample.labels, sample.value


def _complete(client: Client, model: str, lora_id: str, folder: Path, out: dict[str, Any]) -> None:
    body = {"model": model, "prompt": "the lighthouse keeper", "max_tokens": NUM_NEW,
            "temperature": 0, "ignore_eos": True, "cache_salt": "tenant-one",
            "atrium_lora_id": lora_id, "atrium_lora_path": str(folder)}  # fmt: skip
    out["status"] = client.post("/v1/completions", json=body, headers=AUTH).status_code


def test_running_and_waiting_adapters_are_named_while_they_run(
    engine: Client, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model = engine.get("/v1/models", headers=AUTH).json()["data"][0]["id"]
    labels, _ = _lora_info(engine)
    assert labels == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    folders = {
        name: make_adapter(tiny_llama_dir, tmp_path / name, seed, 4, 8.0, ["q_proj", "v_proj"])
        for name, seed in (("la_first", 1), ("la_second", 2))
    }
    results: dict[str, dict[str, Any]] = {name: {} for name in folders}
    started = time.time()
    threads = []
    for name, folder in folders.items():  # one at a time: the second waits (max_num_seqs=1)
        thread = threading.Thread(
            target=_complete, args=(engine, model, name, folder, results[name])
        )
        thread.start()
        threads.append(thread)
        time.sleep(0.05)
    seen: set[tuple[str, str]] = set()
    deadline = time.monotonic() + 60
    while any(thread.is_alive() for thread in threads) and time.monotonic() < deadline:
        labels, value = _lora_info(engine)
        assert labels["max_lora"] == "2"
        seen.add((labels["running_lora_adapters"], labels["waiting_lora_adapters"]))
        assert started - 1.0 <= value <= time.time()
        time.sleep(0.02)
    for thread in threads:
        thread.join(60)
    assert [r["status"] for r in results.values()] == [200, 200]
    assert ("la_first", "la_second") in seen  # the first runs, the second waits for its seat
    assert ("la_second", "") in seen
    # The engine's snapshot as it goes idle names no adapter.
    deadline = time.monotonic() + 5
    while _lora_info(engine)[0]["running_lora_adapters"] and time.monotonic() < deadline:
        time.sleep(0.02)
    labels, value = _lora_info(engine)
    assert (labels["running_lora_adapters"], labels["waiting_lora_adapters"]) == ("", "")
    assert started <= value <= time.time()
