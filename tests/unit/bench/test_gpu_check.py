"""The GPU check's CPU side: the summary it writes, the include scan, and the install stage
failing loudly (its dry run is tests/e2e/test_gpu_check_dry_run.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import gpu_install, gpu_summary
from bench.gpu_modules import include_closure
from bench.gpu_serve import CheckFailedError, expect_no_compile, startup_record


def test_the_summary_gathers_every_stage(tmp_path: Path) -> None:
    (tmp_path / "stages.tsv").write_text("install\t0\t9\nwarmup\t0\t150\ntests\t1\t60\n")
    (tmp_path / "warmup.json").write_text(
        json.dumps(
            {
                "prefill_kernel": "fa2",
                "modules": [{"module": "m1", "compile_s": 81.5}],
                "serve_kernels": [{"family": "decode", "name": "m1", "where": "cached"}],
            }
        )
    )
    (tmp_path / "gpu_tests.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="0">'
        '<testcase classname="t" name="ok"/><testcase classname="t" name="bad"><failure/>'
        "</testcase></testsuite></testsuites>"
    )
    decode = [
        {"batch": b, "tok_per_s": 10.0 * b, "step_ms": 5.0, "bandwidth_util": 0.5} for b in (1, 32)
    ]
    decode[1]["graph_step_ms"] = 1.234
    decode[1]["overlap_step_ms"] = 1.016
    bench = {"device_name": "H200", "prefill": {"tok_per_s": 9e4, "mfu": 0.41}, "decode": decode}
    (tmp_path / "gpu_bench_flashinfer.json").write_text(json.dumps(bench))
    (tmp_path / "serve.json").write_text(
        json.dumps(
            {
                "ok": False,
                "device": "cuda",
                "ready_s": 30.5,
                "startup_s": 41.2,
                "kernels": {"prebuilt": 0, "cached": 3, "to_compile": 0, "missing": []},
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
    assert summary["serve_kernels"] == {"m1": "cached"}  # found by `atrium kernels build --check`
    assert summary["serve"]["startup_s"] == 41.2 and summary["serve"]["kernels"]["to_compile"] == 0
    assert summary["tests"]["failed"] == ["t::bad"] and summary["tests"]["tests"] == 3
    assert summary["bench"]["flashinfer"]["prefill_mfu"] == 0.41
    assert summary["bench"]["flashinfer"]["decode"]["32"]["tok_per_s"] == 320
    assert summary["bench"]["flashinfer"]["decode"]["32"]["graph_step_ms"] == 1.23
    assert summary["bench"]["flashinfer"]["decode"]["1"]["graph_step_ms"] is None
    assert summary["bench"]["flashinfer"]["decode"]["32"]["overlap_step_ms"] == 1.02
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


def test_the_serve_stage_reads_the_start_from_the_servers_log() -> None:
    log = "\n".join([
        "not json",
        json.dumps({"event": "flashinfer_kernels", "prebuilt": 2, "cached": 1, "to_compile": 1,
                    "missing": ["batch_decode_x"]}),
        json.dumps({"event": "serve_ready", "startup_s": 17.25, "role": "all"}),
    ])  # fmt: skip
    record = startup_record(log)
    assert record["startup_s"] == 17.25
    assert record["kernels"] == {"prebuilt": 2, "cached": 1, "to_compile": 1,
                                 "missing": ["batch_decode_x"]}  # fmt: skip
    with pytest.raises(CheckFailedError, match="modules compiled at start: \\['batch_decode_x'\\]"):
        expect_no_compile(record)
    record["kernels"].update(to_compile=0, missing=[])
    assert expect_no_compile(record) == {"modules": 3}
    # The torch backend (the CPU dry run) logs no kernels: on CUDA that is a failure.
    assert startup_record(log.splitlines()[2])["kernels"] is None
    with pytest.raises(CheckFailedError, match="no flashinfer_kernels"):
        expect_no_compile(startup_record(""))
