"""Public prefixes from SQL into the gateway's own engine (all-in-one): all of them at start, so
they survive restarts; at once after an admin change here; and by polling the set's version, so
changes made elsewhere (the CLI, another gateway) arrive within ``poll_s``."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Protocol

import structlog

from engine.async_engine import AsyncEngine, EngineClient
from engine.errors import EngineDeadError
from engine.process_engine import ProcessEngine
from engine.public_prefix_sync import HeldPrefix, PrefixEntry, PublicPrefixSync
from tenants.domain import TenantDomain
from tenants.public_prefixes import PublicPrefixService
from web.ops.errors import ApiError

log = structlog.get_logger("atrium.prefix_delivery")
STATE_KEY = "prefix_delivery"
DEFAULT_POLL_S = 2.0


class ServedModel(Protocol):
    """What delivery reads of the served model (``web.openai.generation.ModelRuntime``)."""

    @property
    def engine(self) -> object: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def kv_capacity_tokens(self) -> int | None: ...


class PrefixDelivery:
    """Keeps one local engine's public prefixes equal to the published rows."""

    def __init__(
        self,
        service: PublicPrefixService,
        sync: PublicPrefixSync,
        runtime: ServedModel,
        poll_s: float = DEFAULT_POLL_S,
    ) -> None:
        self._service = service
        self._sync = sync
        self._runtime = runtime
        self._poll_s = poll_s
        self._task: asyncio.Task[None] | None = None

    def held(self, prefix_id: str) -> HeldPrefix | None:
        return self._sync.held(prefix_id)

    @property
    def max_tokens(self) -> int:
        """The longest prefix this engine can compute (its context less the one sampled token,
        and no more than its KV cache holds)."""
        runtime = self._runtime
        limit = runtime.max_model_len - 1
        if runtime.kv_capacity_tokens is not None:
            limit = min(limit, runtime.kv_capacity_tokens)
        return limit

    async def check(self, text: str) -> None:
        """A 400 when ``text`` is longer than this engine can hold."""
        num_tokens = len(await asyncio.to_thread(self._runtime.tokenizer.encode, text))
        if num_tokens > self.max_tokens:
            raise ApiError(
                400,
                f"The prefix has {num_tokens} tokens; this engine holds at most {self.max_tokens}.",
                code="context_length_exceeded",
                param="text",
            )

    async def refresh(self) -> None:
        """Apply the published rows now (nothing to do when the version is unchanged)."""
        published = await self._service.published()
        if published.version == self._sync.version:
            return
        entries = [PrefixEntry(p.id, p.text) for p in published.prefixes]
        await self._sync.apply(entries, published.version)

    async def start(self) -> None:
        try:
            await self.refresh()
        except Exception as exc:  # serve anyway; the poll tries again
            log.warning("public_prefix_delivery_failed", error=repr(exc))
        log.info("public_prefixes_delivered", num_prefixes=len(self._sync.held_ids))
        self._task = asyncio.create_task(self._poll(), name="atrium-public-prefixes")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            try:
                if await self._service.version() != self._sync.version:
                    await self.refresh()
            except EngineDeadError:
                return  # nothing left to deliver to; the gateway reports the engine itself
            except Exception as exc:  # the database away: try again at the next poll
                log.warning("public_prefix_poll_failed", error=repr(exc))


def local_engine(engine: object) -> EngineClient | None:
    """``engine`` when it runs in this gateway's process tree, None when it is remote (HTTP)."""
    return engine if isinstance(engine, AsyncEngine | ProcessEngine) else None


async def start_prefix_delivery(
    state: Any, runtime: ServedModel, poll_s: float = DEFAULT_POLL_S
) -> PrefixDelivery | None:
    """Deliver the published prefixes to the app's engine, when it has a database and a local
    engine; left on ``state`` for the admin routes. None otherwise (engines then poll)."""
    domain = state.get("tenant_domain")
    engine = local_engine(runtime.engine)
    if not isinstance(domain, TenantDomain) or engine is None:
        return None
    delivery = PrefixDelivery(domain.public_prefixes, PublicPrefixSync(engine), runtime, poll_s)
    await delivery.start()
    state[STATE_KEY] = delivery
    return delivery


def delivery_of(state: Any) -> PrefixDelivery | None:
    found = state.get(STATE_KEY)
    return found if isinstance(found, PrefixDelivery) else None
