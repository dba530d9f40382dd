"""Batches in SQL: creation from an uploaded file, status, cancellation, and its lines' claims.

Status: ``validating`` → ``in_progress`` → ``finalizing`` → ``completed`` (or ``expired`` past
its window, ``cancelled`` after ``cancelling``); ``failed`` when validation refuses it. A line is
claimed by one gateway's lease with a compare-and-set UPDATE (``pending`` → ``running``); a
claim whose lease expired is taken again, so two gateways never run a line at the same time,
and a gateway that died leaves nothing stuck. Counts are counted from the lines when read.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import msgspec
from sqlalchemy import ColumnElement, and_, func, or_, select, update

from tenants.batch_files import INPUT_PURPOSE, FileInfo
from tenants.batch_input import parse_input
from tenants.database import Database
from tenants.errors import (
    ConflictError,
    InvalidInputError,
    InvalidKeyError,
    NotFoundError,
    TenantSuspendedError,
)
from tenants.key_policy import is_live
from tenants.key_rows import auth_context
from tenants.models import (
    ApiKey,
    BatchFile,
    BatchLineRow,
    BatchRow,
    GatewayLease,
    Tenant,
    UsageEventRow,
)
from tenants.schemas import AuthContext
from tenants.timeutil import Clock, utc_now

WINDOWS = {"24h": timedelta(hours=24)}
INSERT_CHUNK = 500
FINAL = ("completed", "failed", "expired", "cancelled")
MAX_METADATA_PAIRS = 16


class RequestCounts(msgspec.Struct, frozen=True):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchUsage(msgspec.Struct, frozen=True):
    """Tokens the batch's lines used so far, every attempt counted (as they were metered)."""

    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


class BatchInfo(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    tenant_id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    errors: list[dict[str, Any]] | None
    metadata: dict[str, str] | None
    created_at: datetime
    expires_at: datetime
    in_progress_at: datetime | None
    finalizing_at: datetime | None
    completed_at: datetime | None
    failed_at: datetime | None
    expired_at: datetime | None
    cancelling_at: datetime | None
    cancelled_at: datetime | None
    request_counts: RequestCounts
    usage: BatchUsage = BatchUsage()


class ClaimedLine(msgspec.Struct, frozen=True, kw_only=True):
    """A line this gateway now runs; ``attempt`` guards its result against a later claim."""

    batch_id: str
    line: int
    custom_id: str
    body: str
    endpoint: str
    tenant_id: str
    key_id: str | None
    attempt: int
    lease_id: str


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def line_request_id(batch_id: str, line: int, attempt: int) -> str:
    """A line's request id for one attempt (each attempt is metered as its own request)."""
    return f"{batch_id}-{line}-{attempt}"


def batch_of_request(request_id: str) -> str | None:
    """The batch a request id belongs to (None for an interactive request)."""
    return request_id.split("-", 1)[0] if request_id.startswith("batch_") else None


def check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidInputError(f"metadata holds at most {MAX_METADATA_PAIRS} pairs", "metadata")
    for key, value in metadata.items():
        if not (0 < len(key) <= 64 and len(value) <= 512):
            raise InvalidInputError(
                "metadata keys are 1 to 64 characters, values at most 512", "metadata"
            )


class BatchStore:
    def __init__(self, db: Database, clock: Clock = utc_now) -> None:
        self._db = db
        self._clock = clock

    # -- the tenant's side -------------------------------------------------------------------

    async def create(
        self,
        tenant_id: str,
        key_id: str | None,
        *,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None = None,
        max_lines: int,
    ) -> BatchInfo:
        """A ``validating`` batch with one pending line per request of the input file."""
        window = WINDOWS.get(completion_window)
        if window is None:
            raise InvalidInputError("completion_window must be 24h", "completion_window")
        check_metadata(metadata)
        now = self._clock()
        async with self._db.transaction() as session:
            source = await session.get(BatchFile, input_file_id)
            if source is None or source.tenant_id != tenant_id:
                raise NotFoundError(f"No such file: {input_file_id}")
            if source.purpose != INPUT_PURPOSE:
                raise InvalidInputError(
                    f"File {input_file_id} has purpose {source.purpose!r}, not 'batch'.",
                    "input_file_id",
                )
            lines = parse_input(source.content, max_lines)
            for number, line in enumerate(lines, start=1):
                if line.url != endpoint:
                    raise InvalidInputError(
                        f"Line {number} is for {line.url}, but the batch's endpoint is {endpoint}.",
                        "input_file_id",
                    )
            row = BatchRow(
                id=new_batch_id(),
                tenant_id=tenant_id,
                key_id=key_id,
                endpoint=endpoint,
                input_file_id=input_file_id,
                completion_window=completion_window,
                status="validating",
                batch_metadata=metadata,
                created_at=now,
                expires_at=now + window,
            )
            session.add(row)
            await session.flush()
            for start in range(0, len(lines), INSERT_CHUNK):
                session.add_all(
                    BatchLineRow(
                        batch_id=row.id,
                        line=index,
                        custom_id=line.custom_id,
                        body=line.body,
                        status="pending",
                        attempts=0,
                    )
                    for index, line in enumerate(lines[start : start + INSERT_CHUNK], start)
                )
                await session.flush()
        return _info(row, RequestCounts(total=len(lines)))

    async def get(self, tenant_id: str, batch_id: str) -> BatchInfo:
        async with self._db.sessions() as session:
            row = await session.get(BatchRow, batch_id)
            if row is None or row.tenant_id != tenant_id:
                raise NotFoundError(f"No such batch: {batch_id}")
            counts = await self._counts(session, [row.id])
            usage = await self._usage(session, [row])
        return _info(row, counts.get(row.id, RequestCounts()), usage.get(row.id))

    async def list_batches(
        self, tenant_id: str, *, limit: int, after: str | None
    ) -> list[BatchInfo]:
        """Newest first; ``after`` is the id of the last batch of the previous page."""
        stmt = select(BatchRow).where(BatchRow.tenant_id == tenant_id)
        async with self._db.sessions() as session:
            if after is not None:
                cursor = await session.get(BatchRow, after)
                if cursor is None or cursor.tenant_id != tenant_id:
                    raise NotFoundError(f"No such batch: {after}")
                stmt = stmt.where(
                    (BatchRow.created_at < cursor.created_at)
                    | ((BatchRow.created_at == cursor.created_at) & (BatchRow.id < cursor.id))
                )
            stmt = stmt.order_by(BatchRow.created_at.desc(), BatchRow.id.desc()).limit(limit)
            rows = list(await session.scalars(stmt))
            return await self._infos(session, rows)

    async def recent(
        self, *, limit: int, tenant_id: str | None = None, statuses: Sequence[str] = ()
    ) -> list[BatchInfo]:
        """Every tenant's batches (or one tenant's), newest first, for operators."""
        stmt = select(BatchRow)
        if tenant_id is not None:
            stmt = stmt.where(BatchRow.tenant_id == tenant_id)
        if statuses:
            stmt = stmt.where(BatchRow.status.in_(list(statuses)))
        stmt = stmt.order_by(BatchRow.created_at.desc(), BatchRow.id.desc()).limit(limit)
        async with self._db.sessions() as session:
            rows = list(await session.scalars(stmt))
            return await self._infos(session, rows)

    async def _infos(self, session: Any, rows: list[BatchRow]) -> list[BatchInfo]:
        counts = await self._counts(session, [row.id for row in rows])
        usage = await self._usage(session, rows)
        return [_info(row, counts.get(row.id, RequestCounts()), usage.get(row.id)) for row in rows]

    async def cancel(self, tenant_id: str, batch_id: str) -> BatchInfo:
        """``cancelling`` now; lines not yet started never start, running ones end first."""
        now = self._clock()
        async with self._db.transaction() as session:
            row = await session.get(BatchRow, batch_id)
            if row is None or row.tenant_id != tenant_id:
                raise NotFoundError(f"No such batch: {batch_id}")
            result = await session.execute(
                update(BatchRow)
                .where(
                    BatchRow.id == batch_id,
                    BatchRow.status.in_(("validating", "in_progress")),
                )
                .values(status="cancelling", cancelling_at=now)
            )
            if not result.rowcount:  # type: ignore[attr-defined]
                raise ConflictError(f"Cannot cancel a batch with status {row.status!r}.")
        return await self.get(tenant_id, batch_id)

    # -- the runner's side -------------------------------------------------------------------

    async def context_of(self, tenant_id: str, key_id: str | None) -> AuthContext:
        """What the key that created a batch speaks for now (its lines stop with the key)."""
        async with self._db.sessions() as session:
            found = None
            if key_id is not None:
                found = (
                    await session.execute(
                        select(ApiKey, Tenant)
                        .join(Tenant, Tenant.id == ApiKey.tenant_id)
                        .where(ApiKey.id == key_id, ApiKey.tenant_id == tenant_id)
                    )
                ).one_or_none()
        if found is None:
            raise InvalidKeyError("The API key that created this batch no longer exists.")
        key, tenant = found
        if not is_live(key.revoked_at, key.expires_at, self._clock()):
            raise InvalidKeyError("The API key that created this batch was revoked or expired.")
        if tenant.status != "active":
            raise TenantSuspendedError(f"tenant {tenant.id} is {tenant.status}")
        return auth_context(key, tenant)

    async def batches_in(self, statuses: Sequence[str], limit: int = 100) -> list[BatchRow]:
        async with self._db.sessions() as session:
            stmt = (
                select(BatchRow)
                .where(BatchRow.status.in_(statuses))
                .order_by(BatchRow.created_at)
                .limit(limit)
            )
            return list(await session.scalars(stmt))

    async def set_status(self, batch_id: str, old: str, new: str, **values: Any) -> bool:
        """Move a batch from ``old`` to ``new`` (compare-and-set); False if it was not ``old``."""
        async with self._db.transaction() as session:
            result = await session.execute(
                update(BatchRow)
                .where(BatchRow.id == batch_id, BatchRow.status == old)
                .values(status=new, **values)
            )
        return bool(result.rowcount)  # type: ignore[attr-defined]

    async def begin_finalizing(self, batch: BatchRow, lease_id: str) -> bool:
        """Take ``batch`` to ``finalizing`` under ``lease_id`` (compare-and-set), or take over
        a finalization whose gateway's lease expired."""
        now = self._clock()
        live = select(GatewayLease.id).where(GatewayLease.expires_at > now)
        if batch.status == "finalizing":
            condition = or_(BatchRow.lease_id.is_(None), BatchRow.lease_id.not_in(live))
        else:
            condition = BatchRow.status == batch.status
        async with self._db.transaction() as session:
            result = await session.execute(
                update(BatchRow)
                .where(BatchRow.id == batch.id, BatchRow.status == batch.status, condition)
                .values(status="finalizing", lease_id=lease_id, finalizing_at=now)
            )
        return bool(result.rowcount)  # type: ignore[attr-defined]

    async def statuses(self, batch_ids: Sequence[str]) -> dict[str, str]:
        if not batch_ids:
            return {}
        async with self._db.sessions() as session:
            rows = await session.execute(
                select(BatchRow.id, BatchRow.status).where(BatchRow.id.in_(list(batch_ids)))
            )
            return {batch_id: status for batch_id, status in rows}

    def _claimable(self, now: datetime) -> ColumnElement[bool]:
        live = select(GatewayLease.id).where(GatewayLease.expires_at > now)
        return or_(
            and_(
                BatchLineRow.status == "pending",
                or_(BatchLineRow.not_before.is_(None), BatchLineRow.not_before <= now),
            ),
            and_(BatchLineRow.status == "running", BatchLineRow.lease_id.not_in(live)),
        )

    async def claim(self, lease_id: str, limit: int) -> list[ClaimedLine]:
        """Up to ``limit`` lines of running batches, oldest batch first, now held by
        ``lease_id``; each claim is a compare-and-set, so a line goes to one gateway."""
        now = self._clock()
        claimable = self._claimable(now)
        async with self._db.sessions() as session:
            candidates = (
                await session.execute(
                    select(
                        BatchLineRow.batch_id,
                        BatchLineRow.line,
                        BatchLineRow.attempts,
                        BatchLineRow.custom_id,
                        BatchLineRow.body,
                        BatchRow.endpoint,
                        BatchRow.tenant_id,
                        BatchRow.key_id,
                    )
                    .join(BatchRow, BatchRow.id == BatchLineRow.batch_id)
                    .where(BatchRow.status == "in_progress", BatchRow.expires_at > now, claimable)
                    .order_by(BatchRow.created_at, BatchLineRow.batch_id, BatchLineRow.line)
                    .limit(limit)
                )
            ).all()
        claimed: list[ClaimedLine] = []
        for batch_id, line, attempts, custom_id, body, endpoint, tenant_id, key_id in candidates:
            async with self._db.transaction() as session:
                result = await session.execute(
                    update(BatchLineRow)
                    .where(
                        BatchLineRow.batch_id == batch_id,
                        BatchLineRow.line == line,
                        BatchLineRow.attempts == attempts,
                        claimable,
                    )
                    .values(status="running", lease_id=lease_id, attempts=attempts + 1)
                )
            if result.rowcount:  # type: ignore[attr-defined]
                claimed.append(
                    ClaimedLine(
                        batch_id=batch_id,
                        line=line,
                        custom_id=custom_id,
                        body=body,
                        endpoint=endpoint,
                        tenant_id=tenant_id,
                        key_id=key_id,
                        attempt=attempts + 1,
                        lease_id=lease_id,
                    )
                )
        return claimed

    async def finish_line(self, claim: ClaimedLine, status: str, result: dict[str, Any]) -> bool:
        """Store a claimed line's result (``completed`` or ``failed``); False when the claim
        was lost meanwhile (its lease expired and another gateway took the line)."""
        return await self._update_claimed(
            claim, status=status, result=result, lease_id=None, finished_at=self._clock()
        )

    async def retry_line(self, claim: ClaimedLine, after_s: float) -> bool:
        """Give a claimed line back, to be claimed again no sooner than ``after_s`` from now."""
        not_before = self._clock() + timedelta(seconds=max(0.0, after_s))
        return await self._update_claimed(
            claim, status="pending", lease_id=None, not_before=not_before
        )

    async def release_orphans(self, lease_id: str, keep: set[tuple[str, int]]) -> int:
        """Lines ``lease_id`` holds that its gateway no longer runs (their result could not be
        stored) go back to pending; returns how many."""
        async with self._db.sessions() as session:
            held = (
                await session.execute(
                    select(BatchLineRow.batch_id, BatchLineRow.line).where(
                        BatchLineRow.status == "running", BatchLineRow.lease_id == lease_id
                    )
                )
            ).all()
        orphans = [(batch_id, line) for batch_id, line in held if (batch_id, line) not in keep]
        for batch_id, line in orphans:
            async with self._db.transaction() as session:
                await session.execute(
                    update(BatchLineRow)
                    .where(
                        BatchLineRow.batch_id == batch_id,
                        BatchLineRow.line == line,
                        BatchLineRow.status == "running",
                        BatchLineRow.lease_id == lease_id,
                    )
                    .values(status="pending", lease_id=None)
                )
        return len(orphans)

    async def _update_claimed(self, claim: ClaimedLine, **values: Any) -> bool:
        async with self._db.transaction() as session:
            result = await session.execute(
                update(BatchLineRow)
                .where(
                    BatchLineRow.batch_id == claim.batch_id,
                    BatchLineRow.line == claim.line,
                    BatchLineRow.status == "running",
                    BatchLineRow.attempts == claim.attempt,
                )
                .values(**values)
            )
        return bool(result.rowcount)  # type: ignore[attr-defined]

    async def num_open_lines(self, batch_id: str, now: datetime) -> tuple[int, int]:
        """(pending, running with a live lease) lines of a batch."""
        live = select(GatewayLease.id).where(GatewayLease.expires_at > now)
        async with self._db.sessions() as session:
            pending = await session.scalar(
                select(func.count()).where(
                    BatchLineRow.batch_id == batch_id, BatchLineRow.status == "pending"
                )
            )
            running = await session.scalar(
                select(func.count()).where(
                    BatchLineRow.batch_id == batch_id,
                    BatchLineRow.status == "running",
                    BatchLineRow.lease_id.in_(live),
                )
            )
        return int(pending or 0), int(running or 0)

    async def finished_lines(self, batch_id: str) -> list[BatchLineRow]:
        async with self._db.sessions() as session:
            stmt = (
                select(BatchLineRow)
                .where(BatchLineRow.batch_id == batch_id)
                .order_by(BatchLineRow.line)
            )
            return list(await session.scalars(stmt))

    async def close(
        self,
        batch: BatchRow,
        lease_id: str,
        final: str,
        *,
        unfinished: list[BatchLineRow],
        files: list[tuple[str, bytes, int]],
    ) -> bool:
        """End a ``finalizing`` batch held by ``lease_id``: store its output and error files
        (``(kind, bytes, lines)``), mark the lines never run, and set its final status."""
        now = self._clock()
        ids: dict[str, str] = {}
        async with self._db.transaction() as session:
            result = await session.execute(
                update(BatchRow)
                .where(
                    BatchRow.id == batch.id,
                    BatchRow.status == "finalizing",
                    BatchRow.lease_id == lease_id,
                )
                .values(status=final, lease_id=None, **{f"{final}_at": now})
            )
            if not result.rowcount:  # type: ignore[attr-defined]
                return False
            for kind, content, num_lines in files:
                file_id = f"file-{secrets.token_hex(12)}"
                ids[f"{kind}_file_id"] = file_id
                session.add(
                    BatchFile(
                        id=file_id,
                        tenant_id=batch.tenant_id,
                        purpose="batch_output",
                        filename=f"{batch.id}_{kind}.jsonl",
                        num_bytes=len(content),
                        num_lines=num_lines,
                        created_at=now,
                        content=content,
                    )
                )
            if ids:
                await session.execute(update(BatchRow).where(BatchRow.id == batch.id).values(ids))
            for row in unfinished:
                await session.execute(
                    update(BatchLineRow)
                    .where(
                        BatchLineRow.batch_id == row.batch_id,
                        BatchLineRow.line == row.line,
                        BatchLineRow.status == "pending",
                    )
                    .values(status="failed", result=row.result, finished_at=now)
                )
        return True

    async def _counts(self, session: Any, batch_ids: list[str]) -> dict[str, RequestCounts]:
        if not batch_ids:
            return {}
        rows = await session.execute(
            select(BatchLineRow.batch_id, BatchLineRow.status, func.count())
            .where(BatchLineRow.batch_id.in_(batch_ids))
            .group_by(BatchLineRow.batch_id, BatchLineRow.status)
        )
        sums: dict[str, dict[str, int]] = {}
        for batch_id, status, count in rows:
            sums.setdefault(batch_id, {})[status] = int(count)
        return {
            batch_id: RequestCounts(
                total=sum(by.values()),
                completed=by.get("completed", 0),
                failed=by.get("failed", 0),
            )
            for batch_id, by in sums.items()
        }

    async def _usage(self, session: Any, rows: Sequence[BatchRow]) -> dict[str, BatchUsage]:
        """The usage events of ``rows``' lines, summed per batch. Read through the events'
        (tenant, started_at) index: a line starts after its batch was created."""
        if not rows:
            return {}
        ev = UsageEventRow
        stmt = (
            select(
                ev.batch_id,
                func.sum(ev.prompt_tokens),
                func.sum(ev.cached_tokens),
                func.sum(ev.completion_tokens),
            )
            .where(
                ev.tenant_id.in_(sorted({row.tenant_id for row in rows})),
                ev.started_at >= min(row.created_at for row in rows),
                ev.batch_id.in_([row.id for row in rows]),
            )
            .group_by(ev.batch_id)
        )
        return {
            batch_id: BatchUsage(int(prompt or 0), int(cached or 0), int(completion or 0))
            for batch_id, prompt, cached, completion in await session.execute(stmt)
        }


def _info(row: BatchRow, counts: RequestCounts, usage: BatchUsage | None = None) -> BatchInfo:
    return BatchInfo(
        id=row.id,
        tenant_id=row.tenant_id,
        endpoint=row.endpoint,
        input_file_id=row.input_file_id,
        completion_window=row.completion_window,
        status=row.status,
        output_file_id=row.output_file_id,
        error_file_id=row.error_file_id,
        errors=row.errors,
        metadata=row.batch_metadata,
        created_at=row.created_at,
        expires_at=row.expires_at,
        in_progress_at=row.in_progress_at,
        finalizing_at=row.finalizing_at,
        completed_at=row.completed_at,
        failed_at=row.failed_at,
        expired_at=row.expired_at,
        cancelling_at=row.cancelling_at,
        cancelled_at=row.cancelled_at,
        request_counts=counts,
        usage=usage or BatchUsage(),
    )


__all__ = [
    "FINAL",
    "BatchInfo",
    "BatchStore",
    "BatchUsage",
    "ClaimedLine",
    "FileInfo",
    "RequestCounts",
]
