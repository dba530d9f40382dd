"""Gateway settings: one frozen struct built from defaults, ``ATRIUM_*`` variables, then flags."""

from __future__ import annotations

import ipaddress
import math
import os
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from engine.config import MAX_MEMORY_FRACTION, PREFILL_KERNELS

ENV_PREFIX = "ATRIUM_"


class SettingsError(ValueError):
    """A setting has a value of the wrong type or out of range."""


def trusted_proxies(value: str | None) -> list[str]:
    """``forwarded_allow_ips`` as a list of addresses and networks (["*"]: every peer); an
    entry that is neither is refused here, where uvicorn would keep it as a literal that
    matches nothing."""
    entries = [entry.strip() for entry in (value or "").split(",") if entry.strip()]
    if entries == ["*"]:
        return entries
    for entry in entries:
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError:
            raise SettingsError(
                f"forwarded_allow_ips must list IP addresses or networks, or be *: {entry!r}"
            ) from None
    return entries


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything `atrium serve` needs to start; every field has an ``ATRIUM_<NAME>`` twin."""

    host: str = "127.0.0.1"
    port: int = 8000
    # Gateways: a second port (on the same host) for /metrics, the admin API and the console,
    # which the public port then answers 404 (None: everything on ``port``).
    internal_port: int | None = None
    # "default", a model folder or .gguf file; several models (each its own engine, KV pool and
    # served name) are separated by commas, each as PATH or NAME=PATH.
    model: str = "default"
    # The name /v1/models shows and requests use (None: the model file's or folder's name).
    served_model_name: str | None = None
    # auto: bfloat16 on CUDA and on CPUs with native bfloat16 products, else float32.
    dtype: str = "auto"
    device: str = "auto"
    database_url: str = "sqlite+aiosqlite:///./atrium.db"
    admin_token: str | None = None
    server_secret: str | None = None
    # Behind a TLS-terminating proxy that sets X-Forwarded-Proto: trust it for the console
    # cookie's Secure flag, from any peer. Off by default, since any client can send the header;
    # forwarded_allow_ips is the stricter way.
    trust_forwarded_proto: bool = False
    # Peers whose X-Forwarded-For and X-Forwarded-Proto count (comma-separated addresses or
    # networks, or "*"): a request from one takes its client address (for the failed-auth limit)
    # and scheme (for the console cookie) from them. None: the headers count from nobody.
    forwarded_allow_ips: str | None = None
    usage_spool_path: str = "./atrium-usage.spool"
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 64
    # The KV pool: kv_cache_bytes when set, else kv_cache_memory_fraction of the memory free once
    # the model is loaded (None: 0.25 of host RAM on CPU, 0.9 of GPU memory), never more than
    # max_num_seqs requests of the full context fill. With several models each engine takes
    # kv_cache_bytes, or kv_cache_memory_fraction / N of the memory free when it starts.
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    max_model_len: int | None = None
    # Tokens a greedy decode may guess from its own context and check in the same step
    # (prompt lookup; 0 turns it off). Outputs are the same either way.
    speculative_tokens: int = 4
    # Steps with more decodes than this run no drafts (None: no limit).
    speculative_max_batch: int | None = None
    # LoRA adapters resident at once (0: adapters off) and the largest rank one may have.
    max_loras: int = 4
    max_lora_rank: int = 16
    # FlashInfer's prefill kernel on CUDA: auto (FA3 on Hopper, FA2 elsewhere), fa2 or fa3.
    prefill_kernel: str = "auto"
    # CUDA only: decode-only steps replay from CUDA graphs captured at start ("on") or run
    # eagerly ("off"); cuda_graph_sizes lists the batch sizes captured (comma-separated; None:
    # 1, 2, 4, 8, then every 8 up to max_num_seqs). Neither applies on a CPU.
    cuda_graphs: str = "on"
    cuda_graph_sizes: str | None = None
    # CUDA only: the host schedules and prepares the next step while the GPU runs a decode step,
    # reading that step's tokens only then ("on"), or waits for each step's tokens ("off").
    overlap_steps: str = "on"
    # The longest a step may take, so each running request's time per output token: "auto"
    # (derived from step costs measured at start), a number of milliseconds, or "off".
    target_tpot_ms: str = "auto"
    # Each request's first-token deadline: the step-time target stretches to meet it (by the
    # square of the wait over it once late) and decodes beyond the target run by weight:
    # milliseconds, or "off".
    target_ttft_ms: str = "2000"
    # Default max_tokens when a request names none: the remaining context, capped at this.
    default_max_tokens_cap: int = 1024
    max_body_bytes: int = 1 * 2**20
    drain_grace_s: float = 30.0
    # The longest a response may run: a stream still going this long after its request arrived
    # is ended (finish_reason "length", metered as delivered). A drain_grace_s at least this long
    # lets every stream finish through a rollout (platform/README.md, "Drain an engine").
    max_stream_s: float = 600.0
    # A gateway renews its lease in the database every third of this; once a lease is this
    # old, another gateway frees the dead one's concurrency slots and budget reservations.
    gateway_lease_s: float = 15.0
    # Every this often, a gateway records on each running request's reservation the output
    # tokens delivered so far: what is billed for it should this gateway die mid-answer.
    usage_checkpoint_s: float = 2.0
    retry_after_s: int = 1
    # HTTP server limits: a request's headers must arrive within header_timeout_s (slow clients
    # are cut off), an idle keep-alive connection closes after keep_alive_timeout_s, and past
    # max_connections open connections a new one gets 503 (0: no limit).
    header_timeout_s: float = 10.0
    keep_alive_timeout_s: int = 5
    max_connections: int = 1024
    otlp_endpoint: str | None = None
    # When set, /metrics answers only `Authorization: Bearer <metrics_token>`.
    metrics_token: str | None = None
    # Label request and token metrics with tenant ids (off: totals only, no tenant ids shown).
    metrics_tenant_labels: bool = False
    # Failed authentications a client address may make in a minute before 429s (0: no limit;
    # behind a reverse proxy not in forwarded_allow_ips every client has the proxy's address).
    auth_failures_per_minute: int = 20
    log_level: str = "info"
    # CPU threads for the model's kernels (None: torch's default, one per core). On a host
    # shared with other busy processes, fewer threads than cores avoids stalls.
    torch_threads: int | None = None
    # Run the engine's step loop in a child process (True) or on a thread of the gateway.
    engine_process: bool = True
    # Scale-out: "all" (gateway and engine in one process tree), "engine" (the model-server
    # API that gateways call) or "gateway" (tenant-facing; generation goes to engine_url, a
    # router or one engine). Both split roles share engine_token, which engines require.
    role: str = "all"
    engine_url: str | None = None
    engine_token: str | None = None
    # Engine role: a gateway (any one; they share the database) whose published public
    # prefixes this engine fetches at start and then every few seconds.
    gateway_url: str | None = None
    # A gateway gives up on an engine that does not accept a connection within
    # engine_connect_timeout_s, or sends nothing for engine_read_timeout_s (first token included).
    engine_connect_timeout_s: float = 2.0
    engine_read_timeout_s: float = 120.0
    # Batch API: lines run at batch_weight_fraction of their tenant's fair-share weight, at most
    # batch_max_concurrency at once per gateway, claimed every batch_poll_s; an input file holds
    # at most batch_max_file_bytes and batch_max_lines requests.
    batch_weight_fraction: float = 0.1
    batch_max_concurrency: int = 4
    batch_poll_s: float = 1.0
    batch_max_file_bytes: int = 16 * 2**20
    batch_max_lines: int = 10_000

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise SettingsError("port must be between 0 and 65535")
        if self.internal_port is not None:
            if not 1 <= self.internal_port <= 65535 or self.internal_port == self.port:
                raise SettingsError("internal_port must be between 1 and 65535, not port")
            if self.role == "engine":
                raise SettingsError("internal_port is a gateway's: engines serve one port")
        name = self.served_model_name
        if name is not None and not (0 < len(name) <= 256 and name.isprintable()):
            raise SettingsError("served_model_name must be 1 to 256 printable characters")
        self._check_models()
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise SettingsError("dtype must be auto, bfloat16, float16 or float32")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise SettingsError("device must be auto, cpu or cuda")
        positive = {
            "max_num_seqs": self.max_num_seqs,
            "default_max_tokens_cap": self.default_max_tokens_cap,
            "max_body_bytes": self.max_body_bytes,
        }
        for name, value in positive.items():
            if value <= 0:
                raise SettingsError(f"{name} must be positive")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise SettingsError("kv_cache_bytes must be positive")
        fraction = self.kv_cache_memory_fraction
        if fraction is not None and not 0 < fraction <= MAX_MEMORY_FRACTION:
            raise SettingsError(f"kv_cache_memory_fraction must be in (0, {MAX_MEMORY_FRACTION}]")
        if not 0 <= self.speculative_tokens <= 64:
            raise SettingsError("speculative_tokens must be between 0 and 64")
        if self.speculative_max_batch is not None and self.speculative_max_batch <= 0:
            raise SettingsError("speculative_max_batch must be positive")
        if not 0 <= self.max_loras <= 256:
            raise SettingsError("max_loras must be between 0 and 256")
        if not 1 <= self.max_lora_rank <= 512:
            raise SettingsError("max_lora_rank must be between 1 and 512")
        if self.prefill_kernel not in PREFILL_KERNELS:
            raise SettingsError(f"prefill_kernel must be one of {', '.join(PREFILL_KERNELS)}")
        if self.torch_threads is not None and self.torch_threads <= 0:
            raise SettingsError("torch_threads must be positive")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            raise SettingsError("max_num_batched_tokens must be positive")
        self.engine_target_tpot_ms  # noqa: B018 (validates)
        self.engine_target_ttft_ms  # noqa: B018 (validates)
        self.engine_cuda_graphs  # noqa: B018 (validates)
        self.engine_overlap_steps  # noqa: B018 (validates)
        sizes = self.engine_cuda_graph_sizes
        if sizes is not None and (min(sizes) <= 0 or max(sizes) > self.max_num_seqs):
            raise SettingsError("cuda_graph_sizes must be batch sizes from 1 to max_num_seqs")
        if self.auth_failures_per_minute < 0:
            raise SettingsError("auth_failures_per_minute must not be negative")
        if not 0 < self.batch_weight_fraction <= 1:
            raise SettingsError("batch_weight_fraction must be in (0, 1]")
        if not 0 < self.batch_poll_s < math.inf:
            raise SettingsError("batch_poll_s must be positive")
        for name in ("batch_max_concurrency", "batch_max_file_bytes", "batch_max_lines"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"{name} must be positive")
        if not 0 < self.gateway_lease_s < math.inf:
            raise SettingsError("gateway_lease_s must be positive")
        if not 0 < self.usage_checkpoint_s < math.inf:
            raise SettingsError("usage_checkpoint_s must be positive")
        if not 0 < self.header_timeout_s < math.inf:
            raise SettingsError("header_timeout_s must be positive")
        if self.keep_alive_timeout_s <= 0:
            raise SettingsError("keep_alive_timeout_s must be positive")
        if self.max_connections < 0:
            raise SettingsError("max_connections must not be negative")
        self._check_role()
        trusted_proxies(self.forwarded_allow_ips)  # validates
        if self.drain_grace_s < 0 or self.retry_after_s < 0:
            raise SettingsError("drain_grace_s and retry_after_s must not be negative")
        if not 0 < self.max_stream_s < math.inf:
            raise SettingsError("max_stream_s must be positive")

    @property
    def model_specs(self) -> list[tuple[str | None, str]]:
        """The served models as (served name or None, model path), from ``model``."""
        specs: list[tuple[str | None, str]] = []
        for entry in self.model.split(","):
            name, sep, path = entry.strip().partition("=") if "=" in entry else ("", "", entry)
            specs.append((name.strip() if sep else None, path.strip()))
        if len(specs) == 1 and specs[0][0] is None:
            return [(self.served_model_name, specs[0][1])]
        return specs

    def single_model(self) -> Settings:
        """These settings for their one model, with NAME=PATH split into the name and path."""
        (name, path), *more = self.model_specs
        if more:
            raise SettingsError("these settings name several models")
        if path == self.model and name == self.served_model_name:
            return self
        return msgspec.structs.replace(self, model=path, served_model_name=name)

    def _check_models(self) -> None:
        if "=" not in self.model and "," not in self.model:
            return
        if self.served_model_name is not None:
            raise SettingsError("with NAME=PATH or several models, name each as NAME=PATH")
        names: list[str] = []
        for name, path in self.model_specs:
            if not path or (name is not None and not (0 < len(name) <= 256 and name.isprintable())):
                raise SettingsError(f"model must be PATH or NAME=PATH, comma-separated: {path!r}")
            names.append(name or path)
        if len(set(names)) != len(names):
            raise SettingsError("each served model needs its own name")
        if len(names) > 1 and self.role == "engine":
            raise SettingsError("the engine role serves one model: start one engine per model")

    @property
    def engine_urls(self) -> list[tuple[str | None, str]]:
        """``engine_url`` as (served model name or None, URL): URL, or NAME=URL per model."""
        found: list[tuple[str | None, str]] = []
        for raw in (self.engine_url or "").split(","):
            entry = raw.strip()
            if not entry:
                continue
            if entry.startswith(("http://", "https://")) or "=" not in entry:
                found.append((None, entry))
            else:
                name, _, url = entry.partition("=")
                found.append((name.strip(), url.strip()))
        return found

    def _check_engine_names(self) -> None:
        """Several models behind a gateway: one NAME=URL for each model's NAME=PATH."""
        urls = self.engine_urls
        if self.role != "gateway" or (len(urls) <= 1 and urls and urls[0][0] is None):
            if self.role == "gateway" and len(self.model_specs) > 1:
                raise SettingsError("with several models, give one --engine-url NAME=URL each")
            return
        names = [name or "" for name, _ in urls]
        models = [name or "" for name, _ in self.model_specs]
        if "" in names or len(set(names)) != len(names) or sorted(names) != sorted(models):
            raise SettingsError(
                "engine_url must name each served model once (NAME=URL), as model does (NAME=PATH)"
            )

    def _check_role(self) -> None:
        if self.role not in ("all", "engine", "gateway"):
            raise SettingsError("role must be all, engine or gateway")
        if self.role != "all" and not self.engine_token:
            raise SettingsError(f"the {self.role} role needs ATRIUM_ENGINE_TOKEN")
        if self.role == "gateway" and not self.engine_url:
            raise SettingsError("the gateway role needs --engine-url (ATRIUM_ENGINE_URL)")
        urls = [("gateway_url", self.gateway_url)]
        urls += [("engine_url", url) for _, url in self.engine_urls]
        for name, url in urls:
            if url is not None and not url.startswith(("http://", "https://")):
                raise SettingsError(f"{name} must be an http:// or https:// URL")
        self._check_engine_names()
        for name in ("engine_connect_timeout_s", "engine_read_timeout_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise SettingsError(f"{name} must be positive")

    @property
    def engine_target_tpot_ms(self) -> float | Literal["auto"] | None:
        """``target_tpot_ms`` as the engine takes it (None: no target)."""
        value = self.target_tpot_ms.strip().lower()
        if value == "auto":
            return "auto"
        return _milliseconds_or_off("target_tpot_ms", value, '"auto", "off"')

    @property
    def engine_target_ttft_ms(self) -> float | None:
        """``target_ttft_ms`` as the engine takes it (None: off)."""
        return _milliseconds_or_off("target_ttft_ms", self.target_ttft_ms.strip().lower(), '"off"')

    @property
    def engine_cuda_graphs(self) -> bool:
        """``cuda_graphs`` as the engine takes it."""
        value = self.cuda_graphs.strip().lower()
        if value not in ("on", "off"):
            raise SettingsError('cuda_graphs must be "on" or "off"')
        return value == "on"

    @property
    def engine_overlap_steps(self) -> bool:
        """``overlap_steps`` as the engine takes it."""
        value = self.overlap_steps.strip().lower()
        if value not in ("on", "off"):
            raise SettingsError('overlap_steps must be "on" or "off"')
        return value == "on"

    @property
    def engine_cuda_graph_sizes(self) -> tuple[int, ...] | None:
        """``cuda_graph_sizes`` as the engine takes it: increasing, without repeats."""
        if self.cuda_graph_sizes is None or not self.cuda_graph_sizes.strip():
            return None
        try:
            sizes = {int(part) for part in self.cuda_graph_sizes.split(",")}
        except ValueError:
            raise SettingsError("cuda_graph_sizes must be comma-separated batch sizes") from None
        return tuple(sorted(sizes))

    @property
    def resolved_device(self) -> str:
        """``auto`` becomes ``cuda`` when a GPU is visible, else ``cpu``."""
        from engine.factory import resolve_device_name

        return resolve_device_name(self.device)

    @property
    def resolved_dtype(self) -> str:
        """``auto`` resolved for the device (``engine.device.resolve_dtype``)."""
        if self.dtype != "auto":
            return self.dtype
        from engine.factory import resolve_dtype_name

        return resolve_dtype_name(self.dtype, self.resolved_device)

    @classmethod
    def load(
        cls, overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> Settings:
        """Defaults, then ``ATRIUM_*`` variables, then ``overrides`` (flags; None means unset)."""
        env = os.environ if environ is None else environ
        raw: dict[str, Any] = {}
        for name in cls.__struct_fields__:
            value = env.get(ENV_PREFIX + name.upper())
            if value is not None and value != "":
                raw[name] = value
        for name, value in (overrides or {}).items():
            if value is not None:
                raw[name] = value
        try:
            # strict=False lets environment strings become ints, floats and optionals.
            return msgspec.convert(raw, type=cls, strict=False)
        except msgspec.ValidationError as exc:
            raise SettingsError(str(exc)) from exc


def _milliseconds_or_off(name: str, value: str, words: str) -> float | None:
    """``value`` as a positive number of milliseconds, or None for "off"."""
    if value == "off":
        return None
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not 0 < number < math.inf:
        raise SettingsError(f"{name} must be {words} or a positive number")
    return number
