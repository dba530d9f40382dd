"""The console's live charts, engines, public prefixes and key lifecycle in Chromium, against
the admin app with a fake fleet of two engines and a registry fed by a traffic thread."""

from __future__ import annotations

import asyncio
import io
import json
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import uvicorn
from litestar import Litestar
from PIL import Image
from prometheus_client import CollectorRegistry, Counter, Histogram

from engine.stats import EngineSnapshot, EngineStats
from radix_cache.stats import NamespaceSnapshot
from tenants.batch_files import FileService
from tenants.batch_store import BatchStore
from tenants.database import Database
from tenants.errors import QuotaExceededError
from tenants.records import UsageEvent
from tenants.usage_store import UsageStore
from tests.browser.console_flow import shot
from tests.browser.test_admin_console_browser import free_port, in_thread
from tests.integration.test_admin_app import ADMIN_TOKEN, build_admin_app, migrated_sqlite
from web.admin.context import live_history_of
from web.admin.live_metrics import ITL_FAMILY, MIN_INTERVAL_S, TTFT_FAMILY
from web.engine_api.fleet import EngineView
from web.ops.metrics import LATENCY_BUCKETS
from web.ops.refusals import RefusalLog

pytestmark = [pytest.mark.browser, pytest.mark.slow]
BLUE = (0x30, 0x56, 0xD3)  # the first line colour of every chart (console/live.js)


def cache(pages: int) -> NamespaceSnapshot:
    return NamespaceSnapshot("", pages, 0, None, 1.0, None, 10, 100, 40, 0, 0)


class TwoEngines:
    """Two engines behind a router: the first busy with two tenants, the second unreachable.
    Counters grow with wall time, so tokens/s is steady."""

    def __init__(self, tenant_ids: list[str]) -> None:
        self.tenant_ids = tenant_ids
        self.started = time.monotonic()
        self.fleet = self

    def stats(self) -> EngineSnapshot:
        busy, idle = self.tenant_ids
        elapsed = time.monotonic() - self.started
        return EngineSnapshot(
            running_by_tenant={busy: 3, idle: 1},
            waiting_by_tenant={busy: 2},
            num_pages_total=512,
            num_pages_free=300,
            num_pages_available=340,
            page_size=16,
            counters=EngineStats(
                num_prefill_tokens=int(900 * elapsed),
                num_generated_tokens=int(120 * elapsed),
                num_preemptions=4,
                num_draft_tokens=100,
                num_accepted_draft_tokens=75,
            ),
            cache_by_namespace={f"tenant:{busy}": cache(150), f"tenant:{idle}": cache(40)},
        )

    async def poll(self) -> list[EngineView]:
        return [
            EngineView("http://engine-a:8000", True, self.stats()),
            EngineView("http://engine-b:8000", False, EngineSnapshot()),
        ]


class Traffic:
    """Observes first-token and inter-token latencies and finished requests (one in ten an
    error) on its own thread until stopped."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram(TTFT_FAMILY, "TTFT", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram(ITL_FAMILY, "ITL", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.requests = Counter(
            "atrium_requests", "Requests", ["endpoint", "status"], registry=self.registry
        )
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        rng = random.Random(7)
        while not self.stop.wait(0.05):
            self.ttft.observe(rng.uniform(0.05, 0.4))
            self.itl.observe(rng.uniform(0.01, 0.06))
            self.requests.labels("chat", "ok" if rng.random() < 0.9 else "error").inc()


class Metrics:
    """The gateway's latency histograms fed by the traffic thread; refusals are counted only
    once ``count_refusals`` was called (a server without the counter until then)."""

    def __init__(self, traffic: Traffic) -> None:
        self.registry = traffic.registry
        self.refusals: Counter | None = None

    def count_refusals(self) -> None:
        self.refusals = Counter(
            "atrium_refusals", "Refused requests", ["status", "reason"], registry=self.registry
        )

    def count_refusal(self, status: int, reason: str) -> None:
        if self.refusals is not None:
            self.refusals.labels(str(status), reason).inc()


@dataclass
class Generation:
    """What the console reads of a gateway's generation service: its refusal log."""

    refusals: RefusalLog


class Console:
    def __init__(
        self, base_url: str, metrics: Metrics, app: Litestar, url: str, refusals: RefusalLog
    ) -> None:
        self.base_url = base_url
        self.root = f"{base_url}/admin/"
        self.metrics = metrics
        self.app = app
        self.url = url
        self.refusals = refusals
        self.api = httpx.Client(
            base_url=f"{base_url}/admin/v1", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        )


@pytest.fixture
def console(tmp_path: Path) -> Iterator[Console]:
    url = in_thread(lambda: migrated_sqlite(tmp_path / "live.db"))
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    traffic = Traffic()
    engines = TwoEngines(["pending", "pending"])
    metrics = Metrics(traffic)
    refusals = RefusalLog()
    app = build_admin_app(
        url,
        engine=engines,
        metrics=metrics,
        generation=Generation(refusals),
        live_sample_s=MIN_INTERVAL_S,
    )
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the admin app did not start"
        time.sleep(0.05)
    found = Console(base_url, metrics, app, url, refusals)
    try:
        engines.tenant_ids = [
            found.api.post("/tenants", json={"name": name}).json()["id"]
            for name in ("acme", "globex")
        ]
        traffic.thread.start()
        yield found
    finally:
        traffic.stop.set()
        found.api.close()
        server.should_exit = True
        thread.join(timeout=10)


def sign_in(page: Any, console: Console) -> None:
    page.goto(console.root)
    page.fill('input[name="token"]', ADMIN_TOKEN)
    page.click('button[type="submit"]')
    page.wait_for_selector("nav a.active")


def coloured_pixels(png: bytes, colour: tuple[int, int, int] = BLUE) -> int:
    """Pixels of a screenshot within a small distance of ``colour``."""
    return _count(Image.open(io.BytesIO(png)), colour)


def _count(image: Image.Image, colour: tuple[int, int, int]) -> int:
    raw = image.convert("RGB").tobytes()
    pixels = zip(raw[0::3], raw[1::3], raw[2::3], strict=True)
    return sum(
        1 for r, g, b in pixels if abs(r - colour[0]) + abs(g - colour[1]) + abs(b - colour[2]) < 60
    )


def plotted_pixels(page: Any, chart: str, prefix: str = "live") -> int:
    """Line-coloured pixels inside the plot area of a chart's canvas screenshot (the legend's
    colour boxes lie outside it and do not count)."""
    canvas = page.locator(f"#{prefix}-{chart} canvas")
    area = page.evaluate(
        "(c) => { const a = Chart.getChart(c).chartArea;"
        " return [a.left, a.top, a.right, a.bottom].map(Math.round); }",
        canvas.element_handle(),
    )
    image = Image.open(io.BytesIO(canvas.screenshot())).crop(tuple(area))
    return _count(image, BLUE)


def test_live_charts_draw_each_series_and_say_which_is_missing(
    page: Any, console: Console, artifacts: Path
) -> None:
    sign_in(page, console)
    page.goto(console.root + "live")
    page.wait_for_function("Number(document.body.dataset.livePoints || 0) >= 2", timeout=20_000)
    for chart in ("tokens", "ttft", "itl", "queue", "kv"):
        panel = page.locator(f"#live-{chart}")
        assert panel.get_attribute("data-state") == "data", chart
        assert panel.locator(".chart-note").is_hidden(), chart
        drawn = plotted_pixels(page, chart)
        assert drawn > 100, f"the {chart} chart shows no line ({drawn} pixels)"
    queue = page.evaluate(
        "Chart.getChart(document.querySelector('#live-queue canvas')).data.datasets"
        ".map((d) => d.label)"
    )
    assert queue == ["acme running", "globex running", "acme waiting"]
    legend = page.evaluate("Chart.getChart(document.querySelector('#live-kv canvas')).data")
    assert [d["label"] for d in legend["datasets"]] == ["acme", "globex"]  # by name, busiest first
    assert legend["datasets"][0]["data"][-1]["y"] == 150
    # No refusal counter in this server's registry: an empty chart that says so.
    refusals = page.locator("#live-refusals")
    assert refusals.get_attribute("data-state") == "missing"
    assert "does not count refusals" in refusals.locator(".chart-note").inner_text()
    assert plotted_pixels(page, "refusals") == 0
    shot(page, artifacts, "01-live")

    # Once the server counts refusals, the chart draws them by reason on the next poll.
    console.metrics.count_refusals()
    stop = threading.Event()

    def refuse() -> None:
        while not stop.wait(0.1):
            console.metrics.count_refusal(429, "requests_per_minute")

    refuser = threading.Thread(target=refuse, daemon=True)
    refuser.start()
    try:
        page.wait_for_selector('#live-refusals[data-state="data"]', timeout=10_000)
        page.wait_for_function(  # a line needs two points
            "Chart.getChart(document.querySelector('#live-refusals canvas'))"
            ".data.datasets[0].data.filter((v) => v.y > 0).length >= 2",
            timeout=10_000,
        )
    finally:
        stop.set()
    assert refusals.locator(".chart-note").is_hidden()
    reasons = page.evaluate(
        "Chart.getChart(document.querySelector('#live-refusals canvas'))"
        ".data.datasets.map((d) => d.label)"
    )
    assert reasons == ["429 requests_per_minute"]
    assert plotted_pixels(page, "refusals") > 50
    shot(page, artifacts, "02-live-refusals")


def test_engines_page_lists_every_engine_with_its_tenants(
    page: Any, console: Console, artifacts: Path
) -> None:
    sign_in(page, console)
    page.goto(console.root + "engines")
    page.wait_for_selector("section.engine")
    cards = page.locator("section.engine")
    assert cards.count() == 2
    assert page.inner_text("#eng-count") == "1 of 2 up."
    up = page.locator('section.engine[data-healthy="true"]')
    assert "http://engine-a:8000" in up.inner_text()
    numbers = up.locator(".engine-numbers").inner_text()
    assert "212 / 512" in numbers and "40" in numbers and "75 %" in numbers  # used, cached, drafts
    tenants = up.locator(".engine-tenants").inner_text()
    assert "acme" in tenants and "globex" in tenants
    down = page.locator('section.engine[data-healthy="false"]')
    assert "unreachable" in down.inner_text() and "No tenant" in down.inner_text()
    png = page.screenshot(full_page=True)
    assert coloured_pixels(png, (0x1F, 0x7A, 0x4D)) > 0  # "up" in green
    assert coloured_pixels(png, (0xB4, 0x23, 0x18)) > 0  # "unreachable" in red
    shot(page, artifacts, "03-engines")


def test_public_prefixes_publish_list_and_unpublish(
    page: Any, console: Console, artifacts: Path
) -> None:
    sign_in(page, console)
    page.goto(console.root + "prefixes")
    page.wait_for_selector("#prefixes-empty:not([hidden])")
    text = "You are a careful assistant.\nAnswer in English."
    page.fill("#prefix-publish textarea", text)
    page.click('#prefix-publish button[type="submit"]')
    row = page.wait_for_selector("#prefixes-table tr[data-prefix-id]")
    assert row.inner_text().startswith(text)
    assert "published" in row.inner_text()
    [stored] = console.api.get("/public-prefixes").json()
    assert stored["text"] == text and stored["created_by"] == "console"
    shot(page, artifacts, "04-prefix-published")

    page.click("#prefixes-table tr[data-prefix-id] button.danger")
    page.wait_for_selector("#prefixes-empty:not([hidden])")
    assert console.api.get("/public-prefixes").json() == []
    page.check("#prefix-show-unpublished")
    row = page.wait_for_selector("#prefixes-table tr[data-prefix-id]")
    assert "unpublished" in row.inner_text() and row.query_selector("button") is None
    page.fill("#prefix-publish textarea", "   ")
    page.click('#prefix-publish button[type="submit"]')
    page.wait_for_selector("#notice.error:not([hidden])")
    shot(page, artifacts, "05-prefix-unpublished")


def test_keys_expiry_and_rotation(page: Any, console: Console, artifacts: Path) -> None:
    tenant = console.api.get("/tenants").json()[0]
    issued = console.api.post(f"/tenants/{tenant['id']}/keys", json={"name": "ci"}).json()
    sign_in(page, console)
    page.goto(f"{console.root}keys?tenant_id={tenant['id']}")
    row = page.locator(f'tr[data-key-id="{issued["id"]}"]')
    assert row.locator('[data-field="expires"]').inner_text() == "never"
    row.locator("button.manage").click()
    dialog = page.locator(f"#manage-{issued['id']}")
    dialog.locator('.key-expiry input[name="expires_at"]').fill("2031-05-06T07:08")
    dialog.locator('form.key-edit button[type="submit"]').click()
    page.wait_for_selector(f'tr[data-key-id="{issued["id"]}"] td:text("2031-05-06 07:08 UTC")')
    assert (
        console.api.get(f"/keys/{issued['id']}")
        .json()["expires_at"]
        .startswith("2031-05-06T07:08:00")
    )

    page.locator(f'tr[data-key-id="{issued["id"]}"] button.manage').click()
    dialog = page.locator(f"#manage-{issued['id']}")
    dialog.locator('.key-rotate input[name="overlap_seconds"]').fill("2")
    dialog.locator('.key-rotate button[type="submit"]').click()
    page.wait_for_selector("#secret-box:not([hidden])")
    new_key = page.inner_text("#secret-value").strip()
    assert new_key.startswith("sk-")
    assert issued["id"] in page.inner_text("#secret-note")
    old = page.wait_for_selector(f'tr[data-key-id="{issued["id"]}"] td.status-retiring')
    assert "works until" in old.inner_text()
    rows = page.locator("#keys-table tbody tr")
    assert rows.count() == 2 and page.locator("#keys-table td.status-active").count() == 1
    stored = console.api.get(f"/keys/{issued['id']}").json()
    assert stored["replaced_by"] is not None and stored["expires_at"] is not None
    shot(page, artifacts, "06-key-rotated")


PAGES = ("", "live", "engines", "tenants", "keys", "batches", "prefixes", "usage", "billing",
         "audit")  # fmt: skip
WIDTHS = (1366, 420)


def seed_spend(console: Console, tenant_id: str, key_id: str, batch: bool) -> str | None:
    """120 tokens of the acme's budget used (metered), a batch with usage, ten refusals."""

    async def run() -> str | None:
        db = await Database.connect(console.url)
        try:
            batch_id = None
            if batch:
                line = {"custom_id": "c0", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"model": "tiny-model", "messages": []}}  # fmt: skip
                content = (json.dumps(line) + "\n").encode()
                upload = await FileService(db).upload(tenant_id, "in.jsonl", content, max_lines=9)
                created = await BatchStore(db).create(
                    tenant_id, key_id, input_file_id=upload.id, endpoint="/v1/chat/completions",
                    completion_window="24h", max_lines=9,
                )  # fmt: skip
                batch_id = created.id
            now = datetime.now(UTC)
            events = [
                UsageEvent(
                    request_id=f"req-{n}",
                    tenant_id=tenant_id,
                    key_id=key_id,
                    model="tiny-model",
                    prompt_tokens=50,
                    cached_tokens=10,
                    completion_tokens=10,
                    status="ok",
                    started_at=now,
                    finished_at=now,
                    charge_budget=True,
                    batch_id=batch_id if n == 0 else None,
                )
                for n in range(2)
            ]
            await UsageStore(db).write(events)
            return batch_id
        finally:
            await db.close()

    batch_id = in_thread(lambda: asyncio.run(run()))
    for _ in range(10):
        console.refusals.record(
            tenant_id,
            key_id,
            QuotaExceededError(
                "monthly token budget exhausted", reason="monthly_token_budget", retry_after_s=9.0
            ),
        )
    return batch_id


def no_sideways_scroll(page: Any, where: str) -> None:
    widths = page.evaluate(
        "[document.documentElement.scrollWidth, window.innerWidth, document.body.scrollWidth]"
    )
    assert widths[0] <= widths[1] and widths[2] <= widths[1], f"{where}: {widths}"


def test_money_limits_batches_and_a_layout_that_never_scrolls_sideways(
    page: Any, console: Console, artifacts: Path
) -> None:
    api = console.api
    acme = next(t for t in api.get("/tenants").json() if t["name"] == "acme")
    quotas = {"monthly_token_budget": 120, "requests_per_minute": 50}
    api.patch(f"/tenants/{acme['id']}", json={"quotas": quotas}).raise_for_status()
    key = api.post(f"/tenants/{acme['id']}/keys", json={"name": "web"}).json()
    price = {"input_per_million": 1_000_000, "cached_input_per_million": 0,
             "output_per_million": 2_000_000, "effective_from": "2020-01-01T00:00:00Z"}  # fmt: skip
    api.put("/prices/tiny-model", json=price).raise_for_status()
    batch_id = seed_spend(console, acme["id"], key["id"], batch=True)
    sign_in(page, console)
    page.set_viewport_size({"width": 1366, "height": 900})

    # Tenants: the spent budget in red with what is left, the spend, the refusals.
    page.goto(console.root + "tenants")
    row = page.locator(f'tr[data-tenant-id="{acme["id"]}"]')
    budget = row.locator('[data-meter="monthly_token_budget"]')
    assert budget.get_attribute("data-state") == "spent"
    assert "120 / 120 tokens" in budget.inner_text() and "0 left" in budget.inner_text()
    assert (
        row.locator('[data-field="spend"]').inner_text() == "0.00012 USD"
    )  # 80 uncached in at 1, 20 out at 2
    assert row.locator('[data-field="refusals"]').inner_text() == "10"
    # Edit opens a dialog over the page: the table keeps its size, the page its width.
    height = row.bounding_box()["height"]
    row.locator('button[data-open^="edit-"]').click()
    dialog = page.locator(f"#edit-{acme['id']}")
    assert dialog.is_visible() and row.bounding_box()["height"] == height
    no_sideways_scroll(page, "tenant dialog")
    shot(page, artifacts, "07-tenant-edit-dialog")
    dialog.locator('input[name="quotas.monthly_cost_budget"]').fill("2.5")
    dialog.locator('button[type="submit"]:not(.danger)').click()
    page.wait_for_selector(
        f'tr[data-tenant-id="{acme["id"]}"] [data-meter="monthly_cost_budget"][data-limit]'
    )
    assert api.get(f"/tenants/{acme['id']}").json()["quotas"]["monthly_cost_budget"] == 2_500_000

    # The tenant's page: every limit used and left, spend, keys, refusals, batches.
    row.locator("a.tenant-link").click()
    page.wait_for_selector("#tenant-limits")
    names = page.eval_on_selector_all(
        "#tenant-limits tr[data-limit]", "rs => rs.map(r => r.dataset.limit)"
    )
    assert names == [
        "requests_per_minute",
        "tokens_per_minute",
        "max_concurrent_requests",
        "monthly_token_budget",
        "monthly_cost_budget",
        "max_prompt_tokens",
    ]
    spent = page.locator('#tenant-limits [data-meter="monthly_token_budget"]')
    assert spent.get_attribute("data-state") == "spent"
    rpm = page.locator('#tenant-limits [data-meter="requests_per_minute"]')
    assert rpm.get_attribute("data-limit") == "50" and "50 left" in rpm.inner_text()
    assert page.inner_text("#tenant-spend-total") == "0.00012 USD"
    assert "tiny-model" in page.inner_text("#tenant-models")
    assert "web" in page.inner_text("#tenant-keys")
    assert "monthly_token_budget: 10" in page.inner_text("#refusal-totals")
    assert page.locator("#refusals-table tbody tr").count() == 10
    batch_row = page.locator(f'#tenant-batches tr[data-batch-id="{batch_id}"]')
    assert batch_row.locator(".progress").get_attribute("data-total") == "1"
    shot(page, artifacts, "08-tenant-page")

    # Keys: the whole key the admin API accepts.
    page.goto(f"{console.root}keys?tenant_id={acme['id']}")
    form = page.locator("#key-issue")
    form.locator('input[name="name"]').fill("batch-only")
    form.locator('input[value="usage:read"]').uncheck()
    form.locator('input[name="models"]').fill("tiny-model")
    form.locator('input[name="requests_per_minute"]').fill("7")
    form.locator('input[name="expires_at"]').fill("2031-01-02T03:04")
    form.locator('button[type="submit"]').click()
    page.wait_for_selector("#secret-box:not([hidden])")
    made = next(
        k for k in api.get(f"/tenants/{acme['id']}/keys").json() if k["name"] == "batch-only"
    )
    assert (made["scopes"], made["models"], made["requests_per_minute"]) == (
        ["inference"], ["tiny-model"], 7,
    )  # fmt: skip
    assert made["expires_at"].startswith("2031-01-02T03:04")

    # Batches: progress and usage of each.
    page.goto(console.root + "batches")
    batch = page.locator(f'#batches-table tr[data-batch-id="{batch_id}"]')
    assert batch.locator('[data-field="input"]').inner_text() == "50"
    assert batch.locator('[data-field="output"]').inner_text() == "10"
    assert "acme" in batch.inner_text()

    # Usage: cost and refusals by tenant, by key and by model.
    page.goto(console.root + "usage")
    page.wait_for_selector(f'#usage-tenants tr[data-tenant-id="{acme["id"]}"]')
    tenant_row = page.inner_text(f'#usage-tenants tr[data-tenant-id="{acme["id"]}"]')
    assert "$0.00012" in tenant_row and tenant_row.rstrip().endswith("10")
    assert "web" in page.inner_text(f'#usage-keys tr[data-key-id="{key["id"]}"]')
    assert "$0.00012" in page.inner_text('#usage-models tr[data-model="tiny-model"]')
    shot(page, artifacts, "09-usage")

    # The overview: rates and charts from the server's samples (taken since it started).
    page.goto(console.root)
    page.wait_for_function("Number(document.body.dataset.overviewPoints || 0) >= 2")
    assert float(page.inner_text("#ov-rps")) > 0 and page.inner_text("#ov-tps") != "–"
    assert "of finished requests" in page.inner_text("#ov-error-rate")
    for chart in ("requests", "tokens"):
        assert plotted_pixels(page, chart, "ov-chart") > 50, chart
    shot(page, artifacts, "10-overview")

    # Live: x positions are the samples' times; a stretch without samples stays a gap.
    history = live_history_of(console.app.state)
    first = history.points[0]
    history.points.appendleft(msgspec.structs.replace(first, at=first.at - timedelta(seconds=166)))
    page.goto(console.root + "live")
    page.select_option("#live-range", "5")
    page.wait_for_selector('#live-tokens[data-state="data"]')
    xs = page.evaluate(
        "Chart.getChart(document.querySelector('#live-tokens canvas')).data.datasets[1].data"
        ".slice(0, 3)"
    )
    assert xs[1]["y"] is None  # the gap: no line across it
    assert xs[2]["x"] - xs[0]["x"] == 166_000
    scale = page.evaluate(
        "(() => { const s = Chart.getChart(document.querySelector('#live-tokens canvas'))"
        ".scales; return [s.x.type, s.y.min]; })()"
    )
    assert scale == ["linear", 0]

    # No page scrolls sideways, wide or narrow.
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 900})
        for slug in (*PAGES, f"tenants/{acme['id']}"):
            page.goto(console.root + slug)
            page.wait_for_load_state("networkidle")
            no_sideways_scroll(page, f"/{slug} at {width} px")
        if width == 420:
            shot(page, artifacts, "11-tenant-page-420")
