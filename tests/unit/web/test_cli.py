"""The atrium CLI: subcommand discovery, environment twins, errors, and a real generation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from web.cli import build_parser, main


def test_subcommands_are_discovered_and_env_twins_set_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ATRIUM_MODEL", "/models/x")
    monkeypatch.setenv("ATRIUM_DTYPE", "float32")
    monkeypatch.setenv("ATRIUM_MAX_TOKENS", "7")
    args = build_parser().parse_args(["generate", "--prompt", "hi"])
    assert (args.model, args.dtype, args.max_tokens, args.raw) == ("/models/x", "float32", 7, False)
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--model", "default"])
    assert args.model == "default"
    export = build_parser().parse_args(["model", "export", "out"])
    assert export.dir == Path("out") and export.func.__name__ == "run_export"


def test_bad_values_exit_2_with_the_reason_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["generate", "--prompt", "hi", "--temperature", "9"])
    captured = capsys.readouterr()
    assert status == 2
    assert "temperature" in captured.err and captured.out == ""
    status = main(["generate", "--prompt", "hi", "--model", "/does/not/exist"])
    assert status == 2 and "not found" in capsys.readouterr().err


def test_generate_with_a_model_directory(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--prompt", "hello", "--model", str(tiny_llama_dir), "--max-tokens", "5"]
    assert main([*argv, "--dtype", "float32", "--seed", "1", "--temperature", "1"]) == 0
    first = capsys.readouterr().out
    assert main([*argv, "--dtype", "float32", "--seed", "1", "--temperature", "1"]) == 0
    assert capsys.readouterr().out == first  # same seed, same text
    assert first.endswith("\n")


@pytest.mark.slow
def test_generate_prints_a_real_answer_with_the_default_model() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "web.cli",
            "generate",
            "--prompt",
            "What is the capital of France?",
            "--max-tokens",
            "24",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
