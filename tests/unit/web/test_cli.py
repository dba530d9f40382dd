"""The atrium CLI: subcommand discovery, environment twins, errors, and a real generation."""

from __future__ import annotations

import argparse
import json
import os
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


def _without_help(parser: argparse.ArgumentParser, path: str) -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += _without_help(sub, f"{path} {name}")
        elif not action.help:
            missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_argument_of_every_command_has_help() -> None:
    assert _without_help(build_parser(), "atrium") == []


def _python(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``script`` run by a fresh interpreter in ``env``; it must exit 0."""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
        check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done


def test_sql_commands_never_load_the_engine(tmp_path: Path) -> None:
    # Each SQL command run for real on a fresh database: the run imports only its own command's
    # module and the tenant domain, never the engine's model code (nor torch), so it answers in
    # about a second.
    script = (
        "import sys\n"
        "from web.cli import main\n"
        "for argv in (['tenants', 'list', '--help'], ['--log-level', 'debug', 'keys', '--help'],"
        " ['tenants', 'create', 'acme'], ['keys', 'create', 'acme', '--name', 'ci'],"
        " ['keys', 'list', 'acme', '--table'], ['usage', '--tenant', 'acme', '--table'],"
        " ['prices', 'list'], ['audit'], ['public-prefixes', 'list'], ['billing', 'export',"
        " '--start', '2031-01-01', '--end', '2031-02-01'], ['db', 'check']):\n"
        "    try:\n"
        "        assert main(argv) == 0, argv\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0, argv\n"
        "heavy = ('torch', 'numpy', 'transformers', 'engine.model', 'engine.llm_engine')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATRIUM_")}
    env["ATRIUM_DATABASE_URL"] = f"sqlite+aiosqlite:///{tmp_path / 'cli.db'}"
    result = _python(script, env)
    assert "usage: atrium tenants list" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "[]"
    # On a database already at head, a read-only command finds so with a plain query and never
    # loads Alembic (the first run above, on an empty database, migrated with it).
    script = (
        "import sys\n"
        "from web.cli import main\n"
        "assert main(['tenants', 'list']) == 0\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'alembic'))\n"
    )
    again = _python(script, env)
    assert '"name":"acme"' in again.stdout
    assert again.stdout.strip().splitlines()[-1] == "[]"


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
    assert main([*argv, "--dtype", "float32", "--seed", "1", "--temperature", "1", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["text"] + "\n" == first  # same seed, same text
    assert answer["model"] == tiny_llama_dir.name and answer["finish_reason"] in ("stop", "length")
    assert answer["prompt_tokens"] > 0 and 0 < answer["completion_tokens"] <= 5


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
