"""The GPU check's CPU side: its dry run up to the first CUDA call, the summary it writes, and the
install stage failing loudly. The dry run uses the ignored bundle (``python -m bench.gpu_bundle``),
or builds one for this Python when there is none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_install, gpu_summary
from bench.gpu_modules import include_closure

ROOT = Path(__file__).parents[3]
BUNDLE = ROOT / ".gpu_bundle"


def test_the_summary_gathers_every_stage(tmp_path: Path) -> None:
    (tmp_path / "stages.tsv").write_text("install\t0\t9\nwarmup\t0\t150\ntests\t1\t60\n")
    (tmp_path / "warmup.json").write_text(
        json.dumps({"prefill_kernel": "fa2", "modules": [{"module": "m1", "compile_s": 81.5}]})
    )
    (tmp_path / "gpu_tests.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="0">'
        '<testcase classname="t" name="ok"/><testcase classname="t" name="bad"><failure/>'
        "</testcase></testsuite></testsuites>"
    )
    decode = [
        {"batch": b, "tok_per_s": 10.0 * b, "step_ms": 5.0, "bandwidth_util": 0.5} for b in (1, 32)
    ]
    bench = {"device_name": "H200", "prefill": {"tok_per_s": 9e4, "mfu": 0.41}, "decode": decode}
    (tmp_path / "gpu_bench_flashinfer.json").write_text(json.dumps(bench))
    (tmp_path / "serve.json").write_text(
        json.dumps(
            {
                "ok": False,
                "device": "cuda",
                "ready_s": 30.5,
                "checks": [
                    {"check": "greedy", "ok": True},
                    {"check": "lora", "ok": False, "error": "404"},
                ],
                "burst": None,
            }
        )
    )
    summary = gpu_summary.summarize(tmp_path)
    assert summary["ok"] is False  # the tests stage failed
    assert summary["serve"]["checks"] == {"greedy": True, "lora": False}
    assert summary["serve"]["failed"] == ["lora: 404"] and summary["serve"]["ready_s"] == 30.5
    assert summary["compile_seconds"] == {"m1": 81.5}
    assert summary["tests"]["failed"] == ["t::bad"] and summary["tests"]["tests"] == 3
    assert summary["bench"]["flashinfer"]["prefill_mfu"] == 0.41
    assert summary["bench"]["flashinfer"]["decode"]["32"]["tok_per_s"] == 320
    assert summary["bench"]["torch"] is None


def test_includes_resolve_like_the_compiler(tmp_path: Path) -> None:
    (tmp_path / "inc" / "a").mkdir(parents=True)
    (tmp_path / "inc" / "a" / "b.h").write_text('#include "c.h"\n#include <vector>\n')
    (tmp_path / "inc" / "a" / "c.h").write_text("  #  include <a/b.h>\n")
    (tmp_path / "k.cu").write_text("#include <a/b.h>\n")
    reached, unresolved = include_closure([tmp_path / "k.cu"], [tmp_path / "inc"])
    names = {p.name for p in reached}
    assert names == {"k.cu", "b.h", "c.h"} and unresolved == {"vector"}


def test_install_fails_loudly_without_a_bundle(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        gpu_install.install(tmp_path / "nothing", tmp_path / "site")


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
