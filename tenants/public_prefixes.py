"""Public prefixes in SQL: publish, list, unpublish (each audited), and the published set with a
version that changes whenever the set does, for gateways and engines to follow."""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import NamedTuple

import msgspec
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from tenants.audit import add_entry
from tenants.database import Database
from tenants.errors import ConflictError, InvalidInputError, NotFoundError
from tenants.key_format import new_id
from tenants.models import PublicPrefixRow
from tenants.timeutil import Clock, utc_now

MAX_PREFIX_CHARS = 200_000  # far beyond any model's context; bounds what one row may hold
MAX_PREFIX_ID_CHARS = 32


class PublicPrefixInfo(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    text: str
    created_at: datetime
    created_by: str
    unpublished_at: datetime | None = None
    unpublished_by: str | None = None


class PublishedSet(NamedTuple):
    version: str  # the same for the same set of live prefixes, wherever it is computed
    prefixes: list[PublicPrefixInfo]  # oldest first


def check_prefix_text(text: str) -> bytes:
    """The text as UTF-8, or InvalidInputError: empty, too long, NUL or unpaired surrogates."""
    if not text.strip():
        raise InvalidInputError("text must not be empty", "text")
    if len(text) > MAX_PREFIX_CHARS:
        raise InvalidInputError(f"text must be at most {MAX_PREFIX_CHARS} characters", "text")
    if "\x00" in text:
        raise InvalidInputError("text must not contain NUL characters", "text")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError("text must be valid Unicode (no lone surrogates)", "text") from exc


def set_version(prefix_ids: list[str]) -> str:
    """A version of the live set: a digest of its ids (an id's text never changes)."""
    digest = hashlib.sha256("\n".join(sorted(prefix_ids)).encode("ascii"))
    return digest.hexdigest()[:32]


def prefix_info(row: PublicPrefixRow) -> PublicPrefixInfo:
    return PublicPrefixInfo(
        id=row.id,
        text=row.text,
        created_at=row.created_at,
        created_by=row.created_by,
        unpublished_at=row.unpublished_at,
        unpublished_by=row.unpublished_by,
    )


class PublicPrefixService:
    def __init__(self, db: Database, clock: Clock = utc_now) -> None:
        self._db = db
        self._clock = clock

    async def publish(self, text: str, *, actor: str = "admin") -> PublicPrefixInfo:
        """Store a new public prefix; ConflictError when the same text is already published."""
        digest = hashlib.sha256(check_prefix_text(text)).hexdigest()
        now = self._clock()
        try:
            async with self._db.transaction() as session:
                live = await session.scalar(
                    select(PublicPrefixRow.id).where(
                        PublicPrefixRow.text_sha256 == digest,
                        PublicPrefixRow.unpublished_at.is_(None),
                    )
                )
                if live is not None:
                    raise ConflictError(f"this text is already published as {live}")
                row = PublicPrefixRow(
                    id=new_id("pp"), text=text, text_sha256=digest, created_at=now, created_by=actor
                )
                session.add(row)
                await session.flush()
                info = prefix_info(row)
                add_entry(
                    session,
                    at=now,
                    actor=actor,
                    action="public_prefix.publish",
                    target=row.id,
                    before=None,
                    after=info,
                )
        except IntegrityError as exc:  # a concurrent publish of the same text
            raise ConflictError("this text is already published") from exc
        return info

    async def get(self, prefix_id: str) -> PublicPrefixInfo:
        async with self._db.sessions() as session:
            row = await session.get(PublicPrefixRow, _check_id(prefix_id))
            if row is None:
                raise NotFoundError(f"no public prefix {prefix_id!r}")
            return prefix_info(row)

    async def list_prefixes(self, *, include_unpublished: bool = False) -> list[PublicPrefixInfo]:
        """Published prefixes (and unpublished ones when asked), oldest first."""
        stmt = select(PublicPrefixRow).order_by(PublicPrefixRow.created_at, PublicPrefixRow.id)
        if not include_unpublished:
            stmt = stmt.where(PublicPrefixRow.unpublished_at.is_(None))
        async with self._db.sessions() as session:
            return [prefix_info(row) for row in await session.scalars(stmt)]

    async def unpublish(self, prefix_id: str, *, actor: str = "admin") -> PublicPrefixInfo:
        """Stop publishing a prefix (the row stays, with who and when); NotFoundError for an
        unknown id, ConflictError when it is already unpublished."""
        now = self._clock()
        async with self._db.transaction() as session:
            row = await session.scalar(
                select(PublicPrefixRow)
                .where(PublicPrefixRow.id == _check_id(prefix_id))
                .with_for_update()
            )
            if row is None:
                raise NotFoundError(f"no public prefix {prefix_id!r}")
            if row.unpublished_at is not None:
                raise ConflictError(f"public prefix {prefix_id} is already unpublished")
            before = prefix_info(row)
            row.unpublished_at, row.unpublished_by = now, actor
            await session.flush()
            after = prefix_info(row)
            add_entry(
                session,
                at=now,
                actor=actor,
                action="public_prefix.unpublish",
                target=row.id,
                before=before,
                after=after,
            )
        return after

    async def version(self) -> str:
        """The live set's version, from its ids only (cheap enough to poll)."""
        async with self._db.sessions() as session:
            ids = await session.scalars(
                select(PublicPrefixRow.id).where(PublicPrefixRow.unpublished_at.is_(None))
            )
            return set_version(list(ids))

    async def published(self) -> PublishedSet:
        """The live prefixes and their version, read together."""
        live = await self.list_prefixes()
        return PublishedSet(set_version([p.id for p in live]), live)


def _check_id(prefix_id: str) -> str:
    if not prefix_id or len(prefix_id) > MAX_PREFIX_ID_CHARS:
        raise NotFoundError(f"no public prefix {prefix_id[:MAX_PREFIX_ID_CHARS]!r}")
    return prefix_id
