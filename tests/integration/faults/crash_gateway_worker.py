"""A gateway process for crash tests: the scripted engine (slow tokens), the database and
lease settings from ``ATRIUM_*`` variables, served by uvicorn until killed.

Usage: PYTHONPATH=<repo> python crash_gateway_worker.py TINY_LLAMA_DIR PORT
"""

from __future__ import annotations

import sys
from pathlib import Path

import uvicorn

from tests.integration.gateway_fakes import make_runtime
from web.app import create_app
from web.settings import Settings

TOKEN_DELAY_S = 0.05  # a 200-token stream lasts ten seconds


def main(model_dir: Path, port: int) -> None:
    runtime, _ = make_runtime(model_dir, delay_s=TOKEN_DELAY_S)
    app = create_app(Settings.load(), engine=runtime, include_admin=False)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
