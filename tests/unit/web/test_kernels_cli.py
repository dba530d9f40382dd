"""`atrium kernels build`: the modules it lists and compiles for a shape, where it finds them, and
its one-line errors. FlashInfer is a stand-in package here (its JIT API: specs with a name, a JIT
library path, an AOT flag and ``build``); tests/gpu and the GPU check run the real one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.attention.backend import BackendUnavailableError
from engine.attention.flashinfer_kernels import check_targets, module_states, set_arch_list
from engine.attention.kernel_plan import KernelShape
from web.cli import main

ROOT = Path(__file__).parents[3]
FAKE_ENV = """
import os, pathlib
ARCHS = os.environ.get("FLASHINFER_CUDA_ARCH_LIST", "")
_tag = "_".join(a.replace(".", "") for a in sorted(ARCHS.split()))
FLASHINFER_JIT_DIR = pathlib.Path(os.environ["FLASHINFER_WORKSPACE_BASE"]) / _tag / "cached_ops"
FLASHINFER_AOT_DIR = pathlib.Path(os.environ["FAKE_AOT_DIR"])
"""
FAKE_MODULES = """
from flashinfer.jit import env

class Spec:
    def __init__(self, name):
        self.name = name
        self.jit_library_path = env.FLASHINFER_JIT_DIR / name / (name + ".so")

    @property
    def is_aot(self):
        return (env.FLASHINFER_AOT_DIR / self.name / (self.name + ".so")).exists()

    def build(self, need_lock=False):
        self.jit_library_path.parent.mkdir(parents=True, exist_ok=True)
        self.jit_library_path.write_text(env.ARCHS)

def _name(kind, backend, dq, dkv, do, idx, hq, hv, *flags):
    return f"{kind}_{backend}_{dq}_{hq}".replace("torch.", "")

def _gen_batch_prefill_primary_module(backend, *args):
    return Spec(_name("prefill", backend, *args))

def _gen_batch_prefill_independent_paged_module(backend, *args):
    return Spec(_name("paged", backend, *args))

def gen_batch_prefill_module(backend, *args):
    return Spec(_name("prefill", backend, *args))

def gen_batch_decode_module(*args):
    return Spec(_name("decode", "fa2", *args))
"""


@pytest.fixture
def flashinfer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A stand-in FlashInfer on sys.path; its JIT cache and AOT folder under ``tmp_path``."""
    package = tmp_path / "site" / "flashinfer"
    (package / "jit" / "attention").mkdir(parents=True)
    (package / "__init__.py").write_text('__version__ = "0.7.2.post1"\n')
    (package / "jit" / "__init__.py").write_text("")
    (package / "jit" / "env.py").write_text(FAKE_ENV)
    (package / "jit" / "attention" / "__init__.py").write_text("")
    (package / "jit" / "attention" / "modules.py").write_text(textwrap.dedent(FAKE_MODULES))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path / "ws"))
    monkeypatch.setenv("FAKE_AOT_DIR", str(tmp_path / "aot"))
    monkeypatch.delenv("FLASHINFER_CUDA_ARCH_LIST", raising=False)
    yield tmp_path
    os.environ.pop("FLASHINFER_CUDA_ARCH_LIST", None)  # set by the command itself
    for name in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]:
        del sys.modules[name]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, object], str]:
    status = main(["kernels", "build", *argv, "--json"])
    out, err = capsys.readouterr()
    return status, (json.loads(out) if out.strip() else {}), err


def test_check_lists_the_default_models_modules_per_gpu(
    flashinfer: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, report, _ = run(capsys, "--check", "--arch-list", "8.0;9.0")
    assert status == 1  # nothing compiled yet
    assert report["arch_list"] == ["8.0", "9.0a"]
    assert report["cache_dir"] == str(flashinfer / "ws" / "80_90a" / "cached_ops")
    modules = report["modules"]
    assert isinstance(modules, list)
    # SmolLM2 (9/3 heads, head size 64): FA2 and the plain decode kernel on Ampere, FA3 on Hopper.
    assert [(m["family"], m["name"], m["where"]) for m in modules] == [
        ("fa2_prefill", "prefill_fa2_bfloat16_64", "missing"),
        ("fa2_prefill_paged", "paged_fa2_bfloat16_64", "missing"),
        ("decode", "decode_fa2_bfloat16_64", "missing"),
        ("fa3_prefill", "prefill_fa3_bfloat16_64", "missing"),
    ]
    status, report, _ = run(capsys, "--dry-run", "--arch-list", "8.0;9.0")
    assert status == 0  # a dry run lists, whatever is missing


def test_build_compiles_what_is_missing_then_check_passes(
    flashinfer: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tools = flashinfer / "bin"
    tools.mkdir()
    for tool in ("nvcc", "g++", "ninja"):
        (tools / tool).write_text("#!/bin/sh\n")
        (tools / tool).chmod(0o755)
    monkeypatch.setenv("PATH", str(tools))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    shape = ["--heads", "32/8", "--head-dim", "128", "--prefill-kernel", "fa2"]
    status, report, _ = run(capsys, *shape, "--arch-list", "9.0a", "--prebuilt")
    assert status == 0
    modules = report["modules"]
    assert isinstance(modules, list)
    assert [(m["family"], m["where"]) for m in modules] == [
        ("fa2_prefill", "prebuilt"), ("fa2_prefill_paged", "prebuilt"),
    ]  # fmt: skip
    built = flashinfer / "aot" / "prefill_fa2_bfloat16_128" / "prefill_fa2_bfloat16_128.so"
    assert built.read_text() == "9.0a"  # compiled for the list, then installed
    manifest = json.loads((flashinfer / "aot" / "atrium-kernels.json").read_text())
    assert manifest == {"paged_fa2_bfloat16_128": ["9.0a"], "prefill_fa2_bfloat16_128": ["9.0a"]}
    status, report, _ = run(capsys, *shape, "--arch-list", "9.0a", "--check")
    assert status == 0


def test_a_build_without_nvcc_says_so(
    flashinfer: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(flashinfer / "nowhere"))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    status, report, err = run(capsys, "--arch-list", "9.0a")
    assert status == 1 and report == {}
    assert err.startswith("atrium kernels build: nvcc and g++ and ninja not found")
    assert not (flashinfer / "ws").exists() or not any((flashinfer / "ws").rglob("*.so"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--heads", "32/8"], "--heads Q/KV (e.g. 32/8) and --head-dim go together"),
        (["--heads", "9/2", "--head-dim", "64"], "not a multiple of 2 KV heads"),
        (["--dtype", "float32"], "bfloat16 or float16, not float32"),
        (["--arch-list", "sm90"], "'sm90' is not a compute capability"),
        (["--model", "/no/such/model"], "model '/no/such/model' not found"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(
    flashinfer: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    status, _, err = run(capsys, "--dry-run", *argv)
    assert status == 2
    assert err == f"atrium kernels build: {err.split(': ', 1)[1]}" and message in err
    assert err.count("\n") == 1


def test_without_a_gpu_the_targets_must_be_named(
    flashinfer: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = run(capsys, "--dry-run")
    assert status == 2 and "no GPU here: name the targets with --arch-list" in err


def test_without_flashinfer_the_command_names_the_install(tmp_path: Path) -> None:
    env = {**os.environ, "FLASHINFER_WORKSPACE_BASE": str(tmp_path)}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [sys.executable, "-m", "web.cli", "kernels", "build", "--check", "--arch-list", "9.0a"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if "flashinfer" in done.stdout.lower():
        pytest.skip("FlashInfer is installed here: the stand-in tests above cover the command")
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("atrium kernels build: FlashInfer is not installed: pip")
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_an_engine_refuses_a_gpu_its_kernels_were_not_built_for(
    flashinfer: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    aot = flashinfer / "aot" / "decode_fa2_bfloat16_64"
    aot.mkdir(parents=True)
    (aot / "decode_fa2_bfloat16_64.so").write_text("9.0a")
    (flashinfer / "aot" / "atrium-kernels.json").write_text(
        json.dumps({"decode_fa2_bfloat16_64": ["9.0a"]})
    )
    shape = KernelShape(9, 3, 64, torch.bfloat16, "fa2")
    set_arch_list(("9.0a",))
    states = module_states(shape, (9,))
    assert [(s.family, s.where) for s in states] == [
        ("fa2_prefill", "missing"), ("fa2_prefill_paged", "missing"), ("decode", "prebuilt"),
    ]  # fmt: skip
    monkeypatch.delenv("FLASHINFER_CUDA_ARCH_LIST")  # as at run time in the image
    check_targets(states, (9, 0))  # an H100: its prebuilt decode module runs there
    with pytest.raises(BackendUnavailableError, match=r"built for 9\.0a, not this GPU \(10\.0\)"):
        check_targets(states, (10, 0))
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "8.0 8.9")
    with pytest.raises(BackendUnavailableError, match="leaves out this GPU"):
        check_targets(states, (9, 0))  # what compiles would target 8.x only
