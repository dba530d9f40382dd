"""The gateway's batch runner: validates new batches, runs their lines, finalizes finished ones.

Every ``batch_poll_s`` it claims lines (under this gateway's lease, see ``tenants.batch_store``)
up to ``batch_max_concurrency`` in flight and runs each through the interactive generation path
as its own metered request, at ``batch_weight_fraction`` of its tenant's fair-share weight. A
line a quota refuses waits and is claimed again later; one refused because the monthly budget
is spent fails. On shutdown (or a drain) lines in flight go back to pending for the next run.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import Any

import msgspec
import structlog
from litestar.datastructures import State

from tenants.batch_store import BatchStore, ClaimedLine, line_request_id
from tenants.errors import QuotaExceededError, TenantError
from tenants.lease_keeper import LeaseKeeper
from tenants.models import BatchRow
from tenants.timeutil import utc_now
from web.openai.batch import results
from web.openai.batch.exec import run_line
from web.openai.generation import GenerationService
from web.openai.pipeline import GenerationPipeline
from web.ops.errors import ApiError, to_api_error
from web.settings import Settings
from web.tenancy.sql import SqlTenancy

log = structlog.get_logger("atrium.batch")
BUDGET_SPENT = ("monthly_token_budget", "monthly_cost_budget")  # refusals that fail a line
BUDGET_ATTEMPTS = 5  # claims of a line the budget refused while its siblings ran
OPEN = ("validating", "in_progress", "cancelling", "finalizing")


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        state: State,
        settings: Settings,
        lease: LeaseKeeper,
        tenancy: SqlTenancy,
    ) -> None:
        self.store = store
        self.state = state
        self.settings = settings
        self.lease = lease
        self.tenancy = tenancy
        self.running: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self._tenants: dict[tuple[str, int], str] = {}  # whose line each running one is
        drop = getattr(state.get("engine"), "drop_tenant", None)
        if callable(drop):  # a suspended or deleted tenant's batch pages go with its own
            tenancy.on_tenant_gone.append(lambda tenant_id: drop(f"{tenant_id}/batch"))

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="batch-runner")

    async def stop(self) -> None:
        """Stop claiming and hand the lines in flight back (pending) for a later run."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._cancel(list(self.running))

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception as error:  # the database may be away: try again next time
                log.warning("batch_tick_failed", error=repr(error))
            await asyncio.sleep(self.settings.batch_poll_s)

    async def tick(self) -> None:
        service: GenerationService | None = self.state.get("generation")
        lease_id = self.lease.lease_id
        if service is None or lease_id is None:
            return
        if service.draining:
            await self._cancel(list(self.running))
            return
        # One query when there is nothing to do (the common case for an idle gateway).
        batches = await self.store.batches_in(OPEN, limit=500)
        if not batches and not self.running:
            return
        await self._validate(service, [b for b in batches if b.status == "validating"])
        await self._watch()
        # Running tasks first: a line claimed just now must not look orphaned.
        if await self.store.release_orphans(lease_id, set(self.running)):
            log.warning("batch_lines_released", lease_id=lease_id)
        await self._finalize(lease_id, [b for b in batches if b.status != "validating"])
        room = self.settings.batch_max_concurrency - len(self.running)
        if room > 0:
            for claim in await self.store.claim(lease_id, room):
                key = (claim.batch_id, claim.line)
                task = asyncio.create_task(self._run(service, claim))
                self.running[key] = task
                self._tenants[key] = claim.tenant_id
                task.add_done_callback(functools.partial(self._done, key))

    def _done(self, key: tuple[str, int], _: asyncio.Task[None]) -> None:
        self.running.pop(key, None)
        self._tenants.pop(key, None)

    async def _validate(self, service: GenerationService, batches: list[BatchRow]) -> None:
        """``validating`` → ``in_progress``, or ``failed`` when a line names a model this
        server does not serve."""
        for batch in batches:
            errors = []
            for row in await self.store.finished_lines(batch.id):
                model = _model_of(row.body)
                if model and service.runtime_for(model) is None:
                    errors.append(
                        {
                            "code": "model_not_found",
                            "message": f"The model `{model}` does not exist.",
                            "param": "body.model",
                            "line": row.line + 1,
                        }
                    )
            now = utc_now()
            if errors:
                await self.store.set_status(
                    batch.id, "validating", "failed", failed_at=now, errors=errors[:100]
                )
            else:
                await self.store.set_status(
                    batch.id, "validating", "in_progress", in_progress_at=now
                )

    async def _watch(self) -> None:
        """Lines in flight of a batch being cancelled (or past its window) stop now."""
        statuses = await self.store.statuses(sorted({b for b, _ in self.running}))
        stopped = [key for key in self.running if statuses.get(key[0]) != "in_progress"]
        await self._cancel(stopped)

    async def _finalize(self, lease_id: str, batches: list[BatchRow]) -> None:
        now = utc_now()
        for batch in batches:
            pending, running = await self.store.num_open_lines(batch.id, now)
            if running and batch.status != "finalizing":
                continue
            if batch.status == "in_progress" and pending and now < batch.expires_at:
                continue
            if await self.store.begin_finalizing(batch, lease_id):
                await self._close(batch, lease_id, now)

    async def _close(self, batch: BatchRow, lease_id: str, now: Any) -> None:
        lines = await self.store.finished_lines(batch.id)
        unfinished = [line for line in lines if line.status == "pending"]
        if batch.cancelling_at is not None:
            final, unfinished = "cancelled", []
        elif unfinished:
            final = "expired"
            for line in unfinished:
                line.result = results.not_run(
                    line.custom_id,
                    "batch_expired",
                    "This line was not run before the batch expired.",
                )
        else:
            final = "completed"
        files = results.output_files(lines)
        if await self.store.close(batch, lease_id, final, unfinished=unfinished, files=files):
            log.info("batch_closed", batch_id=batch.id, status=final, lines=len(lines))

    async def _cancel(self, keys: list[tuple[str, int]]) -> None:
        tasks = [self.running[key] for key in keys if key in self.running]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, service: GenerationService, claim: ClaimedLine) -> None:
        request_id = line_request_id(claim.batch_id, claim.line, claim.attempt)
        try:
            result = await self._result(service, claim, request_id)
        except asyncio.CancelledError:
            await asyncio.shield(self.store.retry_line(claim, 0.0))
            raise
        except _RetryLaterError as retry:
            await self.store.retry_line(claim, retry.after_s)
            return
        except Exception as error:
            log.warning("batch_line_not_stored", request_id=request_id, error=repr(error))
            return
        status = "completed" if results.succeeded(result) else "failed"
        try:
            stored = await self.store.finish_line(claim, status, result)
        except Exception as error:  # the line is released at a later tick and runs again
            log.warning("batch_line_not_stored", request_id=request_id, error=repr(error))
            return
        if not stored:
            log.warning("batch_line_claim_lost", request_id=request_id)

    async def _result(
        self, service: GenerationService, claim: ClaimedLine, request_id: str
    ) -> dict[str, Any]:
        try:
            ctx = await self.store.context_of(claim.tenant_id, claim.key_id)
            principal = self.tenancy.batch_principal(
                ctx, claim.batch_id, self.settings.batch_weight_fraction
            )
            pipeline = GenerationPipeline(service)
            raw = claim.body.encode()
            body = await run_line(pipeline, principal, claim.endpoint, raw, request_id)
        except QuotaExceededError as error:
            if error.reason not in BUDGET_SPENT:  # a rate or concurrency quota frees up
                raise _RetryLaterError(error.retry_after_s) from error
            siblings = sum(t == claim.tenant_id for t in self._tenants.values()) - 1
            if siblings > 0 and claim.attempt < BUDGET_ATTEMPTS:
                # The tenant's other lines in flight may hold more of the budget reserved than
                # they will use: look again shortly, a few times, before failing the line.
                raise _RetryLaterError(self.settings.batch_poll_s) from error
            spent = ApiError(
                429,
                f"{error} This line was not run.",
                code="insufficient_quota",
            )
            return results.refusal(claim.custom_id, request_id, spent)
        except (ApiError, TenantError, Exception) as error:
            api = to_api_error(error)
            if api.status_code == 503:  # overloaded, draining, database away: later
                raise _RetryLaterError(self.settings.batch_poll_s) from error
            if api.status_code >= 500:
                log.error("batch_line_failed", request_id=request_id, exc_info=error)
            return results.refusal(claim.custom_id, request_id, api)
        return results.success(claim.custom_id, request_id, body)


class _RetryLaterError(Exception):
    def __init__(self, after_s: float) -> None:
        super().__init__(after_s)
        self.after_s = after_s


def _model_of(body: str) -> str:
    try:
        value = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return ""
    model = value.get("model") if isinstance(value, dict) else None
    return model if isinstance(model, str) else ""
