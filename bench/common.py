"""What benchmark entry points share: quiet logging, output paths, JSON printing, ratios, and
the machine a result was measured on."""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from pathlib import Path
from typing import Any

import structlog

from web.ops.logging import stderr_now

DEFAULT_OUT_DIR = Path("bench/out")
# The CPU features that decide the served dtype and the kernels: bfloat16 products, AMX tiles.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def quiet_logging() -> None:
    """Only warnings and errors from the engine; library chatter off (benchmarks print JSON)."""
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(stderr_now()),
    )
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)


def _clean(value: Any) -> Any:
    """JSON has no NaN: write null instead; round floats for readability."""
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else round(value, 6)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def emit(result: dict[str, Any], out_dir: Path, name: str) -> Path:
    """Print ``result`` as JSON on stdout and write it to ``out_dir/name.json``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_clean(result), indent=2, sort_keys=False)
    path = out_dir / f"{name}.json"
    path.write_text(text + "\n", encoding="utf-8")
    print(text)
    return path


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else math.nan


def machine_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The CPU's name, family and model, the features of ``CPU_FLAGS`` it has, and the core
    count: the machine class the README's tables are kept by (empty fields off Linux)."""
    fields: dict[str, str] = {}
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block describes them all
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {
        "cpu": fields.get("model name", ""),
        "vendor": fields.get("vendor_id", ""),
        "family": fields.get("cpu family", ""),
        "model": fields.get("model", ""),
        "flags": [f for f in CPU_FLAGS if f in flags],
        "cores": os.cpu_count(),
    }
