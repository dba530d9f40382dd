"""Gather the GPU check's stage results into one ``summary.json``: versions, compile seconds
per module, tests, the serve stage's checks and burst, prefill MFU and decode bandwidth per batch.
``python -m bench.gpu_summary OUT``
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def stages(path: Path) -> list[dict[str, Any]]:
    """``stages.tsv``: one ``name<TAB>exit status<TAB>seconds`` line per stage run."""
    if not path.is_file():
        return []
    rows = [line.split("\t") for line in path.read_text(encoding="utf-8").splitlines() if line]
    return [{"stage": n, "status": int(rc), "seconds": int(s)} for n, rc, s in rows]


def tests(path: Path) -> dict[str, Any] | None:
    """Counts and the failing tests' names from pytest's JUnit XML."""
    if not path.is_file():
        return None
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    counts = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    return {**counts, "failed": failed}


def bench(report: dict[str, Any] | None) -> dict[str, Any] | None:
    if report is None:
        return None
    return {
        "device_name": report["device_name"],
        "prefill_tok_per_s": round(report["prefill"]["tok_per_s"]),
        "prefill_mfu": round(report["prefill"]["mfu"], 4),
        "decode": {
            str(row["batch"]): {
                "tok_per_s": round(row["tok_per_s"]),
                "step_ms": round(row["step_ms"], 2),
                "bandwidth_util": round(row["bandwidth_util"], 4),
                "graph_step_ms": (
                    round(row["graph_step_ms"], 2) if "graph_step_ms" in row else None
                ),
                "overlap_step_ms": (
                    round(row["overlap_step_ms"], 2) if "overlap_step_ms" in row else None
                ),
            }
            for row in report["decode"]
        },
    }


def serve(report: dict[str, Any] | None) -> dict[str, Any] | None:
    """The serve stage's checks by name (passed or not), its failures and its burst."""
    if report is None:
        return None
    checks = report.get("checks") or []
    return {
        "ok": report.get("ok", False),
        "device": report.get("device"),
        "ready_s": report.get("ready_s"),
        "startup_s": report.get("startup_s"),
        "kernels": report.get("kernels"),
        "checks": {c["check"]: c["ok"] for c in checks},
        "failed": [f"{c['check']}: {c.get('error', '')}" for c in checks if not c["ok"]],
        "error": report.get("error"),
        "burst": report.get("burst"),
    }


def summarize(out: Path) -> dict[str, Any]:
    warmup = _json(out / "warmup.json") or {}
    ran = stages(out / "stages.tsv")
    return {
        "ok": bool(ran) and all(s["status"] == 0 for s in ran),
        "stages": ran,
        "versions": _json(out / "versions.json"),
        "prefill_kernel": warmup.get("prefill_kernel"),
        "compile_seconds": {m["module"]: m["compile_s"] for m in warmup.get("modules", [])},
        "serve_kernels": {m["name"]: m["where"] for m in warmup.get("serve_kernels", [])},
        "warmup_steps": warmup.get("steps"),
        "tests": tests(out / "gpu_tests.xml"),
        "serve": serve(_json(out / "serve.json")),
        "bench": {
            name: bench(_json(out / f"gpu_bench_{name}.json")) for name in ("flashinfer", "torch")
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    out = Path(args[0]) if args else Path("gpu_check_out")
    summary = summarize(out)
    text = json.dumps(summary, indent=1)
    (out / "summary.json").write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
