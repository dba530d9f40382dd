"""Debian's Chromium for the browser tests, installed once per machine.

``make test`` starts ``python3 tests/support/chromium.py`` in the background before it builds
the venv, so the download and install overlap the set-up instead of holding a test worker; the
browser fixture calls ``ensure_chromium`` too, which waits for an install in progress. A lock file
serializes the two (and browser modules on different workers): apt refuses a second install
while one holds its lock. Standard library only: it runs before the venv exists.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
LOCK = Path(os.environ.get("TMPDIR", "/tmp")) / "atrium-chromium-install.lock"


def _install() -> None:
    if shutil.which("apt-get") is None:
        raise RuntimeError("chromium is missing and apt-get is not available to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]
    if subprocess.run(install, env=env, timeout=900, check=False).returncode != 0:
        # A fresh machine may have no package lists yet.
        subprocess.run(["apt-get", "update"], env=env, timeout=600, check=True)
        subprocess.run(install, env=env, timeout=900, check=True)


def ensure_chromium() -> Path:
    """``/usr/bin/chromium``, installed first if it is missing (waiting for an install that
    another process started)."""
    if CHROMIUM.exists():
        return CHROMIUM
    with LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not CHROMIUM.exists():
                _install()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return CHROMIUM


if __name__ == "__main__":
    try:
        print(ensure_chromium())
    except (RuntimeError, subprocess.SubprocessError) as exc:  # the fixture reports it again
        print(f"chromium not installed: {exc}", file=sys.stderr)
        sys.exit(1)
