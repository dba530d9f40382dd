"""Chromium (Debian's, installed on demand) driven by Playwright, and where screenshots go."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "console"


@pytest.fixture(scope="session")
def chromium() -> Path:
    if not CHROMIUM.exists():
        if shutil.which("apt-get") is None:
            pytest.fail("chromium is missing and apt-get is not available to install it")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]
        if subprocess.run(install, env=env, timeout=900, check=False).returncode != 0:
            # A fresh machine may have no package lists yet.
            subprocess.run(["apt-get", "update"], env=env, timeout=600, check=True)
            subprocess.run(install, env=env, timeout=900, check=True)
    return CHROMIUM


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
