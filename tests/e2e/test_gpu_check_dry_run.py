"""The GPU check's CPU dry run: everything up to the first CUDA call, the serve stage's checks on
a CPU server included, from the ignored bundle (``python -m bench.gpu_bundle``) or one built for
this Python when there is none. It waits mostly on downloads and child processes, so it sits with
the end-to-end tests, which the suite starts first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
BUNDLE = ROOT / ".gpu_bundle"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built bundle, or one built now for this Python alone (pruned FlashInfer from PyPI,
    about a minute and a half): what the dry run installs is what a GPU run installs."""
    if (BUNDLE / "manifest.json").is_file():
        return BUNDLE
    out = tmp_path_factory.mktemp("gpu_bundle")
    local = f"{sys.version_info.major}.{sys.version_info.minor}"
    built = subprocess.run(
        [sys.executable, "-m", "bench.gpu_bundle", "--out", str(out / "bundle"),
         "--cache", str(out / "cache"), "--python", local],
        cwd=ROOT, capture_output=True, text=True, timeout=400, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    return out / "bundle"


@pytest.mark.slow
def test_the_dry_run_passes_up_to_the_first_cuda_call(bundle: Path, tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "SITE": str(tmp_path / "site"),
           "PYTHON": sys.executable, "BUNDLE": str(bundle)}  # fmt: skip
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [s["stage"] for s in summary["stages"]] == [
        "tools", "install", "import", "warmup", "tests", "serve", "bench",
    ]  # fmt: skip
    assert summary["ok"] and summary["tests"]["tests"] == summary["tests"]["skipped"] > 0
    # The serve stage's driver, on CPU: every check of a GPU run passed, the burst measured.
    serve = summary["serve"]
    assert serve["ok"] and serve["device"] == "cpu" and serve["failed"] == []
    assert set(serve["checks"]) >= {"greedy", "seeded", "logprobs", "json_schema", "tool_call",
                                    "two_tenants", "lora", "disconnect", "burst"}  # fmt: skip
    assert serve["burst"]["streams"] == 8 and serve["burst"]["ttft_p99_ms"] > 0
    # FlashInfer comes from the bundle; tvm_ffi too, unless this Python has the same version.
    packages = {p["module"]: p for p in summary["versions"]["packages"]}
    assert packages["flashinfer"]["installed"]
    manifest = json.loads((bundle / "manifest.json").read_text())
    needed = {w["module"]: w["version"] for w in manifest["wheels"]}
    assert packages["tvm_ffi"]["version"] == needed["tvm_ffi"]
