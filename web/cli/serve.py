"""`atrium serve`: the gateway and its engine process under uvicorn, drained on SIGINT/SIGTERM.

The first signal stops admissions (new requests get 503 with Retry-After) while running requests
finish within the grace period (the rest are aborted); then the server stops and usage is flushed.
A second signal stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import structlog
import uvicorn
from litestar import Litestar
from rich.console import Console

from tenants.database import Database
from tenants.schema_version import SchemaState, schema_state
from web.app import app_for_role
from web.cli.runner import DATABASE_HELP
from web.ops.logging import configure_logging
from web.ops.server_protocol import guarded_protocol
from web.settings import Settings, SettingsError, trusted_proxies

log = structlog.get_logger("atrium.serve")
# How long the start-up check waits for the tenant database before leaving it to the outage path.
SCHEMA_CHECK_TIMEOUT_S = 5.0
_IMPORTED_AT = time.monotonic()  # where the process's own start time cannot be read


def process_age_s(stat: Path = Path("/proc/self/stat")) -> float:
    """Seconds since this process started: from the kernel's record on Linux (the interpreter's
    start and imports included), else since this module was imported."""
    try:
        # Field 22, after the command name in parentheses (which may hold spaces).
        ticks = int(stat.read_text().rpartition(")")[2].split()[19])
        started = ticks / os.sysconf("SC_CLK_TCK")
        return round(time.clock_gettime(time.CLOCK_BOOTTIME) - started, 2)
    except (OSError, ValueError, IndexError, AttributeError):
        return round(time.monotonic() - _IMPORTED_AT, 2)


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose shutdown signal first drains the generation service."""

    def __init__(self, config: uvicorn.Config, app: Litestar, grace_s: float) -> None:
        super().__init__(config)
        self._app = app
        self._grace_s = grace_s
        self._drain_task: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            announce(self._app.state.get("settings"), self._bound_port())

    def _bound_port(self) -> int:
        """The port listened on (the one asked for, or the one picked for port 0)."""
        for server in self.servers:
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return int(self.config.port)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        service = self._app.state.get("generation")
        if self._drain_task is not None or service is None:
            # Second signal, or nothing started yet: stop now.
            self.force_exit = self.should_exit and sig == signal.SIGINT
            self.should_exit = True
            return
        log.info("drain_started", signal=signal.Signals(sig).name, grace_s=self._grace_s)
        service.draining = True  # runs on the loop's thread: refuse new work from now on
        loop = asyncio.get_running_loop()
        self._drain_task = loop.create_task(self._drain(service))

    async def _drain(self, service: Any) -> None:
        try:
            await service.drain(self._grace_s)
        finally:
            log.info("drain_finished")
            self.should_exit = True


def announce(settings: Settings | None, port: int) -> None:
    """Where to send requests and where the console is: a line on a terminal, else an event."""
    host = "127.0.0.1" if settings is None else settings.host
    role = "all" if settings is None else settings.role
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    base = f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"
    api_url = f"{base}/v1"
    console_url = None if role == "engine" else f"{base}/admin/"
    startup_s = process_age_s()
    if sys.stderr.isatty():
        where = f"Atrium is ready in {startup_s:.1f} s: send requests to [bold]{api_url}[/]"
        if console_url is not None:
            where += f", the console is at [bold]{console_url}[/]"
        Console(file=sys.stderr, highlight=False).print(where + " (Ctrl+C stops)", soft_wrap=True)
    else:
        log.info(
            "serve_ready", api_url=api_url, console_url=console_url, role=role, startup_s=startup_s
        )


class Repeated(argparse.Action):
    """A flag given several times: its values joined by commas, as one setting holds them."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        earlier = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, values if earlier is None else f"{earlier},{values}")


def register(subparsers: Any) -> None:
    """Add `serve` to the `atrium` command line."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "serve", help="start the OpenAI-compatible gateway and its engine"
    )
    parser.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default 8000)")
    parser.add_argument(
        "--internal-port",
        dest="internal_port",
        type=int,
        default=None,
        help="gateways: serve /metrics, the admin API and the console on this port only",
    )
    parser.add_argument(
        "--model",
        action=Repeated,
        default=None,
        help="'default' or a model dir / .gguf file, as PATH or NAME=PATH; repeat it to serve "
        "several models, each in its own engine",
    )
    parser.add_argument(
        "--served-model-name",
        dest="served_model_name",
        default=None,
        help="the name /v1/models shows and requests use (default: the model's own name)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["auto", "bfloat16", "float16", "float32"],
        help="auto (default): bfloat16 on CUDA and on CPUs with native bfloat16, else float32",
    )
    parser.add_argument(
        "--database-url", dest="database_url", default=None, metavar="URL", help=DATABASE_HELP
    )
    parser.add_argument(
        "--forwarded-allow-ips",
        dest="forwarded_allow_ips",
        default=None,
        help="proxies whose X-Forwarded-For/-Proto count: comma-separated addresses or "
        "networks, or * (default: none)",
    )
    parser.add_argument("--device", default=None, help="auto, cpu or cuda")
    parser.add_argument(
        "--threads", dest="torch_threads", type=int, default=None, help="CPU threads for the model"
    )
    parser.add_argument(
        "--speculative-tokens",
        dest="speculative_tokens",
        type=int,
        default=None,
        help="tokens a greedy decode may guess from its own context per step (default 4; 0: off)",
    )
    parser.add_argument(
        "--speculative-max-batch",
        dest="speculative_max_batch",
        type=int,
        default=None,
        help="steps with more decodes than this run no drafts (default: no limit)",
    )
    parser.add_argument(
        "--max-loras",
        dest="max_loras",
        type=int,
        default=None,
        help="LoRA adapters resident at once (default 4; 0: adapters off)",
    )
    parser.add_argument(
        "--max-lora-rank",
        dest="max_lora_rank",
        type=int,
        default=None,
        help="the largest rank an adapter may have (default 16)",
    )
    parser.add_argument(
        "--target-tpot-ms",
        dest="target_tpot_ms",
        default=None,
        help="the longest a step may take (time per output token): auto (default), off or ms",
    )
    parser.add_argument(
        "--target-ttft-ms",
        dest="target_ttft_ms",
        default=None,
        help="each request's first-token deadline: the step-time target stretches to meet it "
        "and the decodes past it run by weight: ms (default 2000), or off",
    )
    parser.add_argument(
        "--cuda-graphs",
        dest="cuda_graphs",
        default=None,
        choices=["on", "off"],
        help="CUDA only: replay decode-only steps from graphs captured at start (default on); "
        "not applicable with --device cpu",
    )
    parser.add_argument(
        "--cuda-graph-sizes",
        dest="cuda_graph_sizes",
        default=None,
        metavar="N,N,...",
        help="CUDA only: the batch sizes captured; a step pads to the next one (default 1,2,4,8, "
        "then every 8 up to max_num_seqs)",
    )
    parser.add_argument(
        "--overlap-steps",
        dest="overlap_steps",
        default=None,
        choices=["on", "off"],
        help="CUDA only: schedule and prepare the next step while the GPU runs a decode step "
        "(default on); not applicable with --device cpu",
    )
    parser.add_argument(
        "--kv-cache-bytes",
        dest="kv_cache_bytes",
        type=int,
        default=None,
        help="KV cache size in bytes (default: a share of the memory free after loading)",
    )
    parser.add_argument(
        "--kv-cache-memory-fraction",
        dest="kv_cache_memory_fraction",
        type=float,
        default=None,
        help="share of free memory for the KV cache (default 0.25 on CPU, 0.9 on CUDA)",
    )
    parser.add_argument(
        "--role",
        default=None,
        choices=["all", "engine", "gateway"],
        help="all (default): gateway and engine; engine: the model server gateways call "
        "(needs ATRIUM_ENGINE_TOKEN); gateway: tenant-facing, generation at --engine-url",
    )
    parser.add_argument(
        "--engine-url",
        dest="engine_url",
        action=Repeated,
        default=None,
        help="gateway role: the router (or one engine) to send generation to; with several "
        "models, one NAME=URL per model (repeat the flag)",
    )
    parser.add_argument(
        "--gateway-url",
        dest="gateway_url",
        default=None,
        help="engine role: a gateway to fetch the published public prefixes from",
    )
    parser.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    flags = {name: getattr(args, name, None) for name in Settings.__struct_fields__}
    try:
        settings = Settings.load(flags)
    except SettingsError as exc:
        print(f"atrium serve: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    problem = schema_problem(settings)
    if problem is not None:
        print(f"atrium serve: {problem}", file=sys.stderr)
        return 1
    app = app_for_role(settings)
    config = server_config(app, settings)
    server = DrainingServer(config, app, settings.drain_grace_s)
    log.info(
        "serve_starting",
        host=settings.host,
        port=settings.port,
        model=settings.model,
        role=settings.role,
    )
    sockets = listening_sockets(settings)
    if sockets is not None:
        log.info("internal_port", port=settings.internal_port)
    server.run(sockets=sockets)
    return 0 if server.started else 1


def listening_sockets(settings: Settings) -> list[socket.socket] | None:
    """With ``internal_port``: the public and the internal socket, both on ``host``; else None
    (uvicorn binds ``port`` itself)."""
    if settings.internal_port is None:
        return None
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sockets = []
    for port in (settings.port, settings.internal_port):
        sock = socket.create_server((settings.host, port), family=family, reuse_port=False)
        sock.set_inheritable(True)
        sockets.append(sock)
    return sockets


def schema_problem(settings: Settings) -> str | None:
    """Why a gateway must not start on its database, or None: a PostgreSQL database that is
    empty, at an older revision than this code, or at a newer one this code cannot run on
    (the rule `atrium db check` applies: ``tenants.schema_version``; SQLite is migrated at
    start). A database that cannot be reached now is left to the outage path."""
    if settings.role == "engine" or settings.database_url.startswith("sqlite"):
        return None

    async def current() -> SchemaState:
        async with asyncio.timeout(SCHEMA_CHECK_TIMEOUT_S):
            db = await Database.connect(settings.database_url)
            try:
                return await schema_state(db)
            finally:
                await db.close()

    try:
        state = asyncio.run(current())
    except Exception as exc:  # unreachable or refused: the gateway starts degraded
        log.warning("schema_check_skipped", error=str(exc))
        return None
    if state.ok:
        return None
    if state.kind in ("too_new", "unknown"):
        return (
            f"the tenant database is at revision {state.revision}, which this version "
            f"({state.head}) cannot run on. Deploy the release that migrated it."
        )
    at = "empty" if state.revision is None else f"at revision {state.revision}"
    return (
        f"the tenant database is {at}; this version needs revision {state.head}. "
        "Run `atrium db upgrade` against it first."
    )


def server_config(app: Any, settings: Settings) -> uvicorn.Config:
    """uvicorn's settings for ``app``: a header deadline, a keep-alive timeout, a connection cap,
    and forwarded headers from the configured proxies only (uvicorn's own default trusts any
    local process)."""
    proxies = trusted_proxies(settings.forwarded_allow_ips)
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
        http=guarded_protocol(
            settings.header_timeout_s, settings.max_connections or None, settings.retry_after_s
        ),
        timeout_keep_alive=settings.keep_alive_timeout_s,
        proxy_headers=bool(proxies),
        forwarded_allow_ips=proxies,
    )
