"""The operator's walk through the console, against any gateway that can make a completion."""

from __future__ import annotations

import csv
import io
import re
import time
from pathlib import Path
from typing import Any, NamedTuple, Protocol

ADMIN_TOKEN = "browser-admin-token-0123456789"
USAGE_WAIT_S = 20.0  # the meter writes in batches: the usage page may need a few reloads


class Usage(NamedTuple):
    """What a completion reported in its ``usage``."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class Gateway(Protocol):
    base_url: str

    def model(self, key: str) -> str:
        """The model the gateway serves (asked with a tenant key)."""
        ...

    def complete(self, key: str) -> int | Usage:
        """Make one completion with ``key``: its usage, or the HTTP status of a refusal."""
        ...


def shot(page: Any, folder: Path, name: str) -> None:
    page.screenshot(path=str(folder / f"{name}.png"), full_page=True)


def number(page: Any, selector: str) -> int:
    return int(page.inner_text(selector).replace(",", ""))


def wait_for_usage(page: Any, url: str, requests: int) -> None:
    """Reload the usage page until its cards count ``requests`` requests."""
    deadline = time.monotonic() + USAGE_WAIT_S
    while True:
        page.goto(url)
        page.wait_for_function("document.getElementById('usage-requests').textContent !== '–'")
        shown = page.inner_text("#usage-requests")
        if shown == f"{requests:,}":
            return
        assert time.monotonic() < deadline, f"usage shows {shown} requests, not {requests}"
        time.sleep(0.25)


def sign_in(page: Any, root: str, folder: Path) -> None:
    page.goto(root)
    shot(page, folder, "01-sign-in")
    page.fill('input[name="token"]', "wrong")
    page.click('button[type="submit"]')
    assert "not valid" in page.inner_text(".notice")
    page.fill('input[name="token"]', ADMIN_TOKEN)
    page.click('button[type="submit"]')
    page.wait_for_selector("#ov-updated:not(:text('never'))")
    assert page.inner_text("#ov-kv").count("/") == 1  # "used / total" pages
    shot(page, folder, "02-overview")


def create_tenant_and_key(page: Any, root: str, folder: Path) -> str:
    page.goto(root + "tenants")
    page.fill('#tenant-create input[name="name"]', "acme")
    page.fill('#tenant-create input[name="weight"]', "2")
    page.click('#tenant-create button[type="submit"]')
    row = page.wait_for_selector('tr[data-tenant-name="acme"]')
    assert "active" in row.inner_text()
    assert "no limit" in row.inner_text()  # neither budget set
    page.fill('#tenant-create input[name="name"]', "acme")
    page.click('#tenant-create button[type="submit"]')
    page.wait_for_selector("#notice.error:not([hidden])")
    assert "'acme' exists" in page.inner_text("#notice")
    assert page.locator('tr[data-tenant-name="acme"]').count() == 1
    shot(page, folder, "03-tenants")

    page.goto(root + "keys")
    assert "no keys yet" in page.inner_text("#keys-list")
    page.fill('#key-issue input[name="name"]', "browser")
    page.click('#key-issue button[type="submit"]')
    page.wait_for_selector("#secret-box:not([hidden])")
    key = page.inner_text("#secret-value").strip()
    assert key.startswith("sk-")
    # The list shows the new key (by its prefix, never the secret) while the secret is on screen.
    listed = page.wait_for_selector("#keys-list tr[data-key-id]").inner_text()
    assert "browser" in listed and "active" in listed and key not in listed
    assert not page.is_visible("#key-issue")
    shot(page, folder, "04-key-issued")
    return key


def set_price(page: Any, root: str, model: str) -> None:
    page.goto(root + "billing")
    page.fill('#price-form input[name="model"]', model)
    page.fill('#price-form input[name="input_per_million"]', "1")
    page.fill('#price-form input[name="cached_input_per_million"]', "0")
    page.fill('#price-form input[name="output_per_million"]', "2")
    page.click('#price-form button[type="submit"]')
    page.wait_for_selector("#prices-table")
    assert "1.00" in page.inner_text("#prices-table")


def check_no_usage_yet(page: Any, root: str, folder: Path) -> None:
    page.goto(root + "usage")
    page.wait_for_function("document.getElementById('usage-requests').textContent === '0'")
    for empty in ("#empty-hour", "#empty-day", "#usage-tenants-empty"):
        assert page.is_visible(empty), f"{empty} should say there is no usage"
    assert page.is_hidden("#usage-tenants") and page.is_hidden("#chart-day")
    assert page.inner_text("#usage-cached-share") == "no prompt tokens yet"
    shot(page, folder, "05-usage-empty")


def check_usage(page: Any, root: str, folder: Path, usage: Usage) -> None:
    wait_for_usage(page, root + "usage", requests=1)
    assert number(page, "#usage-prompt") == usage.prompt_tokens
    assert number(page, "#usage-cached") == usage.cached_tokens
    assert number(page, "#usage-completion") == usage.completion_tokens
    tenant_row = page.inner_text('#usage-tenants tr:has(td:text("acme"))')
    assert f"{usage.prompt_tokens:,}" in tenant_row
    assert page.is_hidden("#empty-day") and page.is_visible("#chart-day")
    shot(page, folder, "06-usage")


def check_billing(page: Any, root: str, folder: Path, model: str, usage: Usage) -> None:
    page.goto(root + "billing")
    page.wait_for_selector("#export-totals:not([hidden])")
    assert page.inner_text('[data-total="requests"]') == "1"
    with page.expect_download() as download_info:
        page.click("#export-download")
    rows = list(csv.DictReader(io.StringIO(Path(download_info.value.path()).read_text())))
    assert [(r["tenant_name"], r["model"], r["requests"]) for r in rows] == [("acme", model, "1")]
    assert int(rows[0]["prompt_tokens"]) == usage.prompt_tokens
    assert int(rows[0]["cached_tokens"]) == usage.cached_tokens
    assert int(rows[0]["completion_tokens"]) == usage.completion_tokens
    uncached = usage.prompt_tokens - usage.cached_tokens
    expected_micros = uncached * 1 + usage.completion_tokens * 2  # 1 and 2 USD per million tokens
    assert rows[0]["cost_micros"] == str(expected_micros)
    shown = page.inner_text('[data-total="cost"]').replace("$", "").replace(",", "")
    assert float(shown) == expected_micros / 1e6
    shot(page, folder, "07-billing")


def revoke_and_audit(page: Any, root: str, folder: Path, gateway: Gateway, key: str) -> None:
    page.goto(root + "keys")
    page.click("tr[data-key-id] button.manage")
    page.click("dialog[open] button.danger")
    page.wait_for_selector("td.status-revoked")
    assert gateway.complete(key) == 401
    shot(page, folder, "08-key-revoked")

    page.goto(root + "audit")
    actions = page.inner_text("#audit-table")
    for action in ("tenant.create", "key.create", "price.set", "key.revoke"):
        assert action in actions
    assert re.search(r"\bconsole\b", actions)
    # Each entry lists only what changed: the revocation sets revoked_at, nothing else.
    revoke = page.inner_text('#audit-table tr:has(code:text("key.revoke")) ul.changes')
    assert revoke.startswith("revoked_at:") and "name" not in revoke
    shot(page, folder, "09-audit")


def walk_the_console(page: Any, gateway: Gateway, folder: Path) -> Usage:
    """Sign in, create a tenant and a key, price the model, complete, check usage and billing,
    revoke the key, read the audit log, sign out. Returns the completion's usage."""
    root = f"{gateway.base_url}/admin/"
    sign_in(page, root, folder)
    key = create_tenant_and_key(page, root, folder)
    model = gateway.model(key)
    set_price(page, root, model)
    check_no_usage_yet(page, root, folder)

    usage = gateway.complete(key)
    assert isinstance(usage, Usage), f"the completion was refused with {usage}"
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
    check_usage(page, root, folder, usage)
    check_billing(page, root, folder, model, usage)
    revoke_and_audit(page, root, folder, gateway, key)

    page.goto(root)
    page.click("header.top form button")
    page.wait_for_selector('input[name="token"]')
    return usage
