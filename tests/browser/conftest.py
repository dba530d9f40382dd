"""Chromium (Debian's, installed on demand by tests/support/chromium.py) driven by Playwright,
and where screenshots go."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.chromium import ensure_chromium

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "console"


@pytest.fixture(scope="session")
def chromium() -> Path:
    try:
        return ensure_chromium()
    except (RuntimeError, subprocess.SubprocessError) as exc:
        pytest.fail(f"chromium is missing and could not be installed: {exc}")


# Module scope: Playwright's sync API keeps an event loop running on the main thread while it is
# open, which would break every later test that calls asyncio.run().
@pytest.fixture(scope="module")
def browser(chromium: Path) -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=str(chromium), headless=True, args=["--no-sandbox"]
        )
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(accept_downloads=True, viewport={"width": 1280, "height": 900})
    opened = context.new_page()
    opened.set_default_timeout(15_000)
    opened.on("dialog", lambda dialog: dialog.accept())
    yield opened
    context.close()


@pytest.fixture
def artifacts(request: pytest.FixtureRequest) -> Path:
    folder = ARTIFACTS / request.node.name
    shutil.rmtree(folder, ignore_errors=True)  # only this run's screenshots
    folder.mkdir(parents=True)
    return folder
