"""`atrium public-prefixes publish`: public prefixes live in a running engine's cache, not in the
database, so this command (unlike the other admin commands) calls a running server's admin API."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import httpx

from web.cli import env_default
from web.cli.output import output_flags, print_one
from web.cli.runner import EXIT_FAILED, EXIT_INVALID, fail

DEFAULT_SERVER = "http://127.0.0.1:8000"
NOTE = (
    "A public prefix is held by the engine's prefix cache, so publishing talks to a running "
    "server's admin API (--server, ATRIUM_SERVER_URL) with the admin token (ATRIUM_ADMIN_TOKEN). "
    "Nothing is stored: publish again after a restart."
)
TIMEOUT_S = 120.0  # the engine computes the prefix's KV before it answers


def _error_message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error", {})
        message = error.get("message") if isinstance(error, dict) else None
    except ValueError:
        message = None
    return f"HTTP {response.status_code}: {message or response.reason_phrase}"


def run_publish(args: argparse.Namespace) -> int:
    name = "public-prefixes publish"
    if args.file is not None:
        try:
            text = args.file.read_text(encoding="utf-8")
        except OSError as exc:
            return fail(name, f"cannot read {args.file}: {exc}", EXIT_INVALID)
    else:
        text = args.text or ""
    if not text.strip():
        return fail(name, "give the prefix text, or --file", EXIT_INVALID)
    if not args.admin_token:
        return fail(name, "no admin token: set ATRIUM_ADMIN_TOKEN or --admin-token", EXIT_INVALID)
    url = f"{args.server.rstrip('/')}/admin/v1/public-prefixes"
    try:
        response = httpx.post(
            url,
            json={"text": text},
            headers={"Authorization": f"Bearer {args.admin_token}"},
            timeout=TIMEOUT_S,
        )
    except httpx.HTTPError as exc:
        return fail(name, f"cannot reach {args.server}: {exc}", EXIT_FAILED)
    if response.status_code >= 400:
        status = EXIT_INVALID if response.status_code < 500 else EXIT_FAILED
        return fail(name, _error_message(response), status)
    return print_one(args, response.json())


def register(subparsers: Any) -> None:
    """Add `public-prefixes` to the `atrium` command line."""
    prefixes = subparsers.add_parser(
        "public-prefixes", help="prefixes every tenant may reuse", description=NOTE
    )
    commands = prefixes.add_subparsers(dest="prefixes_command", required=True)
    publish = commands.add_parser(
        "publish", help="publish a prefix on a running server", description=NOTE
    )
    publish.add_argument("text", nargs="?", help="the prefix text (or --file)")
    publish.add_argument("--file", type=Path, help="read the prefix text from this file")
    publish.add_argument(
        "--server", default=env_default("ATRIUM_SERVER_URL", DEFAULT_SERVER), help="server URL"
    )
    publish.add_argument(
        "--admin-token", default=env_default("ATRIUM_ADMIN_TOKEN"), help="(env ATRIUM_ADMIN_TOKEN)"
    )
    output_flags(publish)
    publish.set_defaults(func=run_publish)
