"""``python -m web.cli``: the ``atrium`` command line."""

from __future__ import annotations

import sys

from web.cli import main

sys.exit(main())
