"""Batch API files kept in SQL: a tenant's uploaded inputs and its batches' output and error files.

The bytes live in the ``batch_files`` row (bounded by the gateway's upload limit); a tenant only
ever sees its own files: another tenant's id reads as not found.
"""

from __future__ import annotations

import secrets
from datetime import datetime

import msgspec
from sqlalchemy import delete, select
from sqlalchemy.orm import defer

from tenants.batch_input import parse_input
from tenants.database import Database
from tenants.errors import NotFoundError
from tenants.models import BatchFile
from tenants.timeutil import Clock, utc_now

INPUT_PURPOSE = "batch"
OUTPUT_PURPOSE = "batch_output"


class FileInfo(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    tenant_id: str
    purpose: str
    filename: str
    num_bytes: int
    num_lines: int
    created_at: datetime


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def file_info(row: BatchFile) -> FileInfo:
    return FileInfo(
        id=row.id,
        tenant_id=row.tenant_id,
        purpose=row.purpose,
        filename=row.filename,
        num_bytes=row.num_bytes,
        num_lines=row.num_lines,
        created_at=row.created_at,
    )


class FileService:
    def __init__(self, db: Database, clock: Clock = utc_now) -> None:
        self._db = db
        self._clock = clock

    async def upload(
        self, tenant_id: str, filename: str, content: bytes, *, max_lines: int
    ) -> FileInfo:
        """Store a batch input after checking every line (InvalidInputError names a bad one)."""
        lines = parse_input(content, max_lines)
        row = BatchFile(
            id=new_file_id(),
            tenant_id=tenant_id,
            purpose=INPUT_PURPOSE,
            filename=filename,
            num_bytes=len(content),
            num_lines=len(lines),
            created_at=self._clock(),
            content=content,
        )
        async with self._db.transaction() as session:
            session.add(row)
        return file_info(row)

    async def get(self, tenant_id: str, file_id: str) -> FileInfo:
        return file_info(await self._row(tenant_id, file_id))

    async def content(self, tenant_id: str, file_id: str) -> tuple[FileInfo, bytes]:
        row = await self._row(tenant_id, file_id, with_content=True)
        return file_info(row), row.content

    async def list_files(
        self, tenant_id: str, *, purpose: str | None, limit: int, after: str | None
    ) -> list[FileInfo]:
        """Newest first; ``after`` is the id of the last file of the previous page."""
        stmt = select(BatchFile).where(BatchFile.tenant_id == tenant_id)
        if purpose is not None:
            stmt = stmt.where(BatchFile.purpose == purpose)
        if after is not None:
            cursor = await self._row(tenant_id, after)
            stmt = stmt.where(
                (BatchFile.created_at < cursor.created_at)
                | ((BatchFile.created_at == cursor.created_at) & (BatchFile.id < cursor.id))
            )
        stmt = stmt.order_by(BatchFile.created_at.desc(), BatchFile.id.desc()).limit(limit)
        stmt = stmt.options(defer(BatchFile.content))  # a page lists files, not their bytes
        async with self._db.sessions() as session:
            return [file_info(row) for row in await session.scalars(stmt)]

    async def delete(self, tenant_id: str, file_id: str) -> None:
        async with self._db.transaction() as session:
            result = await session.execute(
                delete(BatchFile).where(BatchFile.id == file_id, BatchFile.tenant_id == tenant_id)
            )
        if not result.rowcount:  # type: ignore[attr-defined]
            raise NotFoundError(f"No such file: {file_id}")

    async def _row(self, tenant_id: str, file_id: str, *, with_content: bool = False) -> BatchFile:
        stmt = select(BatchFile).where(BatchFile.id == file_id)
        if not with_content:
            stmt = stmt.options(defer(BatchFile.content))
        async with self._db.sessions() as session:
            row = await session.scalar(stmt)
        if row is None or row.tenant_id != tenant_id:
            raise NotFoundError(f"No such file: {file_id}")
        return row
