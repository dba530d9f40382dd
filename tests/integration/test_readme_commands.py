"""The README's commands are the real CLI's: every `atrium …` it shows parses with the real
parser, and the shell blocks of its tenant and command-line sections run in bash, in order,
against a fresh SQLite database, each command exiting 0. Their `.venv/bin/atrium` is the CLI's
`main` in a fork of a process that imported it once (tests/support/cli_forks.py): a dozen
interpreter starts would cost ten seconds; `tests/unit/web/test_cli.py` starts the real one.

A block that needs a running server (`curl` to the API) carries the marker
``<!-- readme-test: skip (why) -->`` on the line before it: starting `atrium serve` with the
default model takes a minute, far more than the rest of this test, and those requests are the
end-to-end tests' work (tests/e2e). The tenant and key the skipped blocks use are still made
by the blocks that run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.support.cli_forks import forked_atrium
from web.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SECTIONS = ("First request", "Operating tenants from the command line")
SKIP = re.compile(r"<!-- readme-test: skip \((?P<why>[^)]+)\) -->")
BLOCK = re.compile(r"(?:^(?P<marker><!--[^\n]*-->)\n)?^```sh\n(?P<code>.*?)^```", re.M | re.S)
INLINE = re.compile(r"`(atrium [^`]+)`")
SHELL_OPERATORS = {"|", "||", "&&", "&", ";", ">", ">>", "<", "(", ")"}


class Block(NamedTuple):
    section: str
    code: str
    skip: str | None  # why it does not run here


def sections(text: str) -> dict[str, str]:
    """Each ``## `` section's body by its heading."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {heading.strip(): body for heading, body in zip(parts[1::2], parts[2::2], strict=True)}


def blocks(text: str) -> list[Block]:
    found = []
    for heading, body in sections(text).items():
        for match in BLOCK.finditer(body):
            marker = match["marker"]
            skip = None
            if marker is not None:
                parsed = SKIP.fullmatch(marker)
                assert parsed is not None, f"unknown marker before a block: {marker}"
                skip = parsed["why"]
            found.append(Block(heading, match["code"], skip))
    return found


def command_lines(code: str) -> list[str]:
    """The block's commands, continuation lines joined, comments dropped."""
    joined = code.replace("\\\n", " ")
    return [line for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def atrium_calls(line: str) -> list[list[str]]:
    """The arguments of every `atrium` the line runs (inside ``$(…)`` too), shell variables
    standing for a value, up to the next shell operator or comment."""
    lexer = shlex.shlex(line.replace("$(", " ( "), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words = list(lexer)
    calls = []
    for index, word in enumerate(words):
        if word.endswith("atrium") and Path(word).name == "atrium":
            args = []
            for arg in words[index + 1 :]:
                if arg in SHELL_OPERATORS:
                    break
                args.append("VALUE" if arg.startswith("$") else arg)
            calls.append(args)
    return calls


def test_the_readme_sections_this_test_runs_exist() -> None:
    text = README.read_text(encoding="utf-8")
    found = sections(text)
    for name in SECTIONS:
        assert name in found, f"README section {name!r} is gone: update SECTIONS"
    runnable = [b for b in blocks(text) if b.section in SECTIONS and b.skip is None]
    assert len(runnable) >= 3
    skipped = [b for b in blocks(text) if b.skip is not None]
    assert all("curl" in b.code for b in skipped), "only requests to a server may be skipped"


def test_every_atrium_command_in_the_readme_parses(capsys: pytest.CaptureFixture[str]) -> None:
    text = README.read_text(encoding="utf-8")
    calls = [
        call
        for block in blocks(text)
        for line in command_lines(block.code)
        for call in atrium_calls(line)
    ]
    # Inline `atrium …` spans, but not summaries such as `atrium tenants|keys …`.
    calls += [
        shlex.split(span)[1:]
        for span in INLINE.findall(text)
        if "…" not in span and "|" not in span
    ]
    assert len(calls) > 20
    for argv in calls:
        try:
            build_parser(argv[0]).parse_args(argv)
        except SystemExit as exc:  # --help exits 0; a wrong flag or value exits 2
            if exc.code != 0:
                pytest.fail(f"`atrium {shlex.join(argv)}` in README.md: {capsys.readouterr().err}")


def test_the_tenant_and_cli_sections_run_against_a_fresh_database(tmp_path: Path) -> None:
    bin_dir = tmp_path / ".venv" / "bin"  # the README runs `.venv/bin/atrium`
    bin_dir.mkdir(parents=True)
    runnable = [
        b
        for b in blocks(README.read_text(encoding="utf-8"))
        if b.section in SECTIONS and not b.skip
    ]
    # One shell, as a reader would go: variables set by one block serve the next. Every command
    # must succeed; the one that fails is named.
    script = "\n".join(
        [
            "set -euo pipefail",
            "trap 'echo \"README command failed: $BASH_COMMAND\" >&2' ERR",
            *(b.code for b in runnable),
        ]
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATRIUM_")}
    env |= {
        "ATRIUM_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'readme.db'}",
        "PYTHONPATH": str(ROOT),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",  # python3
    }
    with forked_atrium(bin_dir, env):
        done = subprocess.run(
            ["bash", "-c", script],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    # What the blocks made is there: the export they wrote, a rotated key, the published prefix.
    assert (tmp_path / "march.csv").read_text().startswith("tenant_id,")
    assert '"replaces":"key_' in done.stdout
    assert "You are a helpful assistant" in done.stdout
