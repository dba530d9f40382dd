"""Shell scripts that call `atrium` at the cost of a fork, not of an interpreter start.

``forked_atrium(bin_dir)`` starts a process that imports the CLI once and puts an ``atrium``
in ``bin_dir`` that hands its arguments, working folder, environment and its stdin, stdout and
stderr (the descriptors themselves) to that process, which runs ``web.cli.main`` in a fork of
itself and answers with the exit status. What the script runs is the real command line in a
real process; only the ~1 s of imports per call is saved.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from web.cli import COMMANDS, main

# The commands that need no model: their modules are imported once, before any fork (a run
# imports only its own command's module).
SQL_COMMANDS = ("db", "keys", "public-prefixes", "prices", "usage", "tenants")

SHIM = """#!{python} -IS
import json, os, socket, sys
with socket.socket(socket.AF_UNIX) as server:
    server.connect({path!r})
    call = {{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}
    socket.send_fds(server, [json.dumps(call).encode()], [0, 1, 2])
    sys.exit(int(server.recv(16) or b"1"))
"""


def serve(path: str) -> None:
    """Answer calls on the socket at ``path``, one at a time, until killed."""
    for command in SQL_COMMANDS:
        importlib.import_module(COMMANDS[command])
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)
        server.listen()
        print("ready", flush=True)
        while True:
            conn, _ = server.accept()
            with conn:
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                call = json.loads(message)
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    _run(call, fds)
                for fd in fds:
                    os.close(fd)
                _, status = os.waitpid(pid, 0)
                conn.sendall(str(os.waitstatus_to_exitcode(status)).encode())


def _run(call: dict[str, Any], fds: list[int]) -> None:
    """In the fork: take the caller's descriptors, folder and environment, run, exit."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.chdir(str(call["cwd"]))
    os.environ.clear()
    os.environ.update(call["env"])
    status: object = 1
    try:
        status = main(call["argv"])
    except SystemExit as exc:  # argparse's usage errors and --help
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status if isinstance(status, int) else 1)


@contextmanager
def forked_atrium(bin_dir: Path, env: dict[str, str]) -> Iterator[Path]:
    """An ``atrium`` in ``bin_dir`` served by forks of one process started with ``env``."""
    folder = Path(tempfile.mkdtemp(prefix="atrium-cli-"))  # short: a socket path has ~100 chars
    path = str(folder / "socket")
    server = subprocess.Popen(
        [sys.executable, "-c", f"from tests.support.cli_forks import serve; serve({path!r})"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        server.stdout.close()
        shim = bin_dir / "atrium"
        shim.write_text(SHIM.format(python=sys.executable, path=path))
        shim.chmod(0o755)
        yield shim
    finally:
        server.kill()
        server.wait()
        (folder / "socket").unlink(missing_ok=True)
        folder.rmdir()
