"""The operator's walk through the console, against any gateway that can make a completion."""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path
from typing import Any, Protocol

ADMIN_TOKEN = "browser-admin-token-0123456789"


class Gateway(Protocol):
    base_url: str

    def model(self, key: str) -> str:
        """The model the gateway serves (asked with a tenant key)."""
        ...

    def complete(self, key: str) -> int:
        """Make one completion with ``key``; returns the HTTP status."""
        ...


def shot(page: Any, folder: Path, name: str) -> None:
    page.screenshot(path=str(folder / f"{name}.png"), full_page=True)


def walk_the_console(page: Any, gateway: Gateway, folder: Path) -> None:
    root = f"{gateway.base_url}/admin/"
    page.goto(root)
    shot(page, folder, "01-sign-in")
    page.fill('input[name="token"]', "wrong")
    page.click('button[type="submit"]')
    assert "not valid" in page.inner_text(".notice")
    page.fill('input[name="token"]', ADMIN_TOKEN)
    page.click('button[type="submit"]')
    page.wait_for_selector("#ov-updated:not(:text('never'))")
    shot(page, folder, "02-overview")

    page.goto(root + "tenants")
    page.fill('#tenant-create input[name="name"]', "acme")
    page.fill('#tenant-create input[name="weight"]', "2")
    page.click('#tenant-create button[type="submit"]')
    row = page.wait_for_selector('tr[data-tenant-name="acme"]')
    assert "active" in row.inner_text()
    shot(page, folder, "03-tenants")

    page.goto(root + "keys")
    page.fill('#key-issue input[name="name"]', "browser")
    page.click('#key-issue button[type="submit"]')
    page.wait_for_selector("#secret-box:not([hidden])")
    key = page.inner_text("#secret-value").strip()
    assert key.startswith("sk-")
    shot(page, folder, "04-key-issued")

    model = gateway.model(key)
    page.goto(root + "billing")
    page.fill('#price-form input[name="model"]', model)
    page.fill('#price-form input[name="input_per_million"]', "1")
    page.fill('#price-form input[name="cached_input_per_million"]', "0")
    page.fill('#price-form input[name="output_per_million"]', "2")
    page.click('#price-form button[type="submit"]')
    page.wait_for_selector("#prices-table")
    assert "1.00" in page.inner_text("#prices-table")

    assert gateway.complete(key) == 200

    page.goto(root + "usage")
    page.wait_for_function("document.getElementById('usage-requests').textContent === '1'")
    prompt_tokens = int(page.inner_text("#usage-prompt").replace(",", ""))
    completion_tokens = int(page.inner_text("#usage-completion").replace(",", ""))
    assert prompt_tokens > 0 and completion_tokens > 0
    shot(page, folder, "05-usage")

    page.goto(root + "billing")
    page.wait_for_selector("#export-totals:not([hidden])")
    assert page.inner_text('[data-total="requests"]') == "1"
    with page.expect_download() as download_info:
        page.click("#export-download")
    rows = list(csv.DictReader(io.StringIO(Path(download_info.value.path()).read_text())))
    assert [(r["tenant_name"], r["model"], r["requests"]) for r in rows] == [("acme", model, "1")]
    assert int(rows[0]["prompt_tokens"]) == prompt_tokens
    assert int(rows[0]["completion_tokens"]) == completion_tokens
    uncached = prompt_tokens - int(rows[0]["cached_tokens"])
    expected_micros = uncached * 1 + completion_tokens * 2  # 1 and 2 USD per million tokens
    assert rows[0]["cost_micros"] == str(expected_micros)
    shown = page.inner_text('[data-total="cost"]').replace("$", "").replace(",", "")
    assert float(shown) == expected_micros / 1e6
    shot(page, folder, "06-billing")

    page.goto(root + "keys")
    page.click("tr[data-key-id] button.danger")
    page.wait_for_selector("td.status-revoked")
    assert gateway.complete(key) == 401
    shot(page, folder, "07-key-revoked")

    page.goto(root + "audit")
    actions = page.inner_text("#audit-table")
    for action in ("tenant.create", "key.create", "price.set", "key.revoke"):
        assert action in actions
    assert re.search(r"\bconsole\b", actions)
    shot(page, folder, "08-audit")

    page.goto(root)
    page.click("header.top form button")
    page.wait_for_selector('input[name="token"]')
