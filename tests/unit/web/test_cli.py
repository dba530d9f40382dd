"""The atrium CLI: subcommand discovery, environment twins, errors, and a real generation."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from web.cli import COMMANDS, build_parser, main


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


def test_the_command_list_names_every_registered_command() -> None:
    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert list(subparsers.choices) == list(COMMANDS)


def test_sql_commands_never_load_the_engine() -> None:
    # `atrium tenants list` on a host without the model's libraries in memory: the command's run
    # imports only its own module, never the engine (nor torch).
    script = (
        "import sys\n"
        "from web.cli import main\n"
        "for argv in (['tenants', 'list', '--help'], ['--log-level', 'debug', 'keys', '--help'],"
        " ['usage', '--help'], ['db', '--help'], ['public-prefixes', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in ('torch', 'engine.async_engine') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert "usage: atrium tenants list" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "[]"


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
