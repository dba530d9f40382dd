"""SQLAlchemy models of the tenant domain; Alembic owns the schema built from them.

Times are stored as naive UTC (``UtcDateTime``) so SQLite and PostgreSQL order them alike.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy import text as sql_text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import DateTime, TypeDecorator

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
# SQLite only autoincrements a column declared exactly INTEGER PRIMARY KEY.
AutoId = BigInteger().with_variant(Integer(), "sqlite")


class UtcDateTime(TypeDecorator[datetime]):
    """Aware datetimes in, aware UTC datetimes out; stored naive UTC."""

    impl = DateTime(timezone=False)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if isinstance(value, str):  # raw SQL results on SQLite
            value = datetime.fromisoformat(value)
        if not isinstance(value, datetime):
            raise TypeError(f"unexpected datetime value from the driver: {value!r}")
        return value.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    weight: Mapped[float] = mapped_column(Float)
    status: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    requests_per_minute: Mapped[int | None] = mapped_column(BigInteger)
    tokens_per_minute: Mapped[int | None] = mapped_column(BigInteger)
    max_concurrent_requests: Mapped[int | None] = mapped_column(BigInteger)
    monthly_token_budget: Mapped[int | None] = mapped_column(BigInteger)
    # Micro-units of the price table's currency (migration 0009).
    monthly_cost_budget: Mapped[int | None] = mapped_column(BigInteger)
    max_prompt_tokens: Mapped[int | None] = mapped_column(BigInteger)
    kv_cache_share: Mapped[float | None] = mapped_column(Float)
    # The tenant's model allow-list (migration 0010); None: every model.
    models: Mapped[list[str] | None] = mapped_column(JSON(none_as_null=True))


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    name: Mapped[str] = mapped_column(String(100))
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    key_hash: Mapped[str] = mapped_column(String(64))  # hex HMAC-SHA256 of the whole key
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    last_used_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    # Lifecycle (migration 0004): the key stops working at ``expires_at`` (a rotation sets it to
    # the end of the overlap and names the successor in ``replaced_by``).
    expires_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    replaced_by: Mapped[str | None] = mapped_column(String(32))
    # Space-separated, e.g. "inference usage:read" (what keys issued before 0004 may do).
    scopes: Mapped[str] = mapped_column(String(100), server_default="inference usage:read")
    models: Mapped[list[str] | None] = mapped_column(JSON(none_as_null=True))  # None: every model
    requests_per_minute: Mapped[int | None] = mapped_column(BigInteger)


class KeyRateBucket(Base):
    """A key's own requests-per-minute bucket, drawn under its tenant's (see ``RateBucket``)."""

    __tablename__ = "key_rate_buckets"

    key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"), primary_key=True)
    requests_drawn: Mapped[float] = mapped_column(Float)
    refilled_at: Mapped[float] = mapped_column(Float)  # epoch seconds


class UsageEventRow(Base):
    """Append-only; no foreign keys so that a late or replayed event can never be refused."""

    __tablename__ = "usage_events"
    __table_args__ = (
        Index("ix_usage_events_model_started_at", "model", "started_at"),
        Index("ix_usage_events_tenant_id_started_at", "tenant_id", "started_at"),
    )

    request_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(32))
    key_id: Mapped[str | None] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(100))
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16))
    started_at: Mapped[datetime] = mapped_column(UtcDateTime)
    finished_at: Mapped[datetime] = mapped_column(UtcDateTime)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    duration_ms: Mapped[float | None] = mapped_column(Float)
    batch_id: Mapped[str | None] = mapped_column(String(40))  # a batch line's (batch price)


class UsageRollup(Base):
    """Hourly sums per tenant and model, updated in the transaction that inserts the events."""

    __tablename__ = "usage_rollups"
    __table_args__ = (Index("ix_usage_rollups_hour", "hour"),)

    tenant_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    model: Mapped[str] = mapped_column(String(100), primary_key=True)
    hour: Mapped[datetime] = mapped_column(UtcDateTime, primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)


class TokenBudget(Base):
    """Monthly token budget state; ``period`` is ``YYYY-MM`` (UTC)."""

    __tablename__ = "token_budgets"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    period: Mapped[str] = mapped_column(String(7), primary_key=True)
    used: Mapped[int] = mapped_column(BigInteger)
    reserved: Mapped[int] = mapped_column(BigInteger)
    # The same in money (micro-units), counted while the tenant has a cost budget.
    cost_used: Mapped[int] = mapped_column(BigInteger, server_default="0", default=0)
    cost_reserved: Mapped[int] = mapped_column(BigInteger, server_default="0", default=0)


class Reservation(Base):
    """An admitted, not yet settled request; deleting it is what makes settle idempotent.

    It is also the request's started record (migration 0005): the lease of the gateway serving
    it, and what a reclaimer needs to write its usage event should that gateway die (with the
    output tokens delivered up to the last checkpoint, migration 0012).
    """

    __tablename__ = "reservations"

    request_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    period: Mapped[str] = mapped_column(String(7))
    tokens: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    lease_id: Mapped[str | None] = mapped_column(String(32), index=True)  # None: no owner known
    key_id: Mapped[str | None] = mapped_column(String(32))
    model: Mapped[str | None] = mapped_column(String(100))
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    cost: Mapped[int] = mapped_column(BigInteger, server_default="0", default=0)  # micro-units
    # Output tokens delivered so far, checkpointed every few seconds by the gateway serving it
    # (migration 0012): what a reclaimer bills should that gateway die mid-answer.
    completion_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0", default=0)


class GatewayLease(Base):
    """A running gateway: it renews ``expires_at`` while alive; once that passes, any gateway
    settles the reservations it held (``Reservation.lease_id``)."""

    __tablename__ = "gateway_leases"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    started_at: Mapped[datetime] = mapped_column(UtcDateTime)
    expires_at: Mapped[datetime] = mapped_column(UtcDateTime, index=True)


class RateBucket(Base):
    """Per-minute token buckets as amounts drawn (draining over time) and the in-flight count.

    Storing what was drawn, not what is left, makes a newly set limit start with a full bucket.
    """

    __tablename__ = "rate_buckets"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    requests_drawn: Mapped[float] = mapped_column(Float)
    tokens_drawn: Mapped[float] = mapped_column(Float)
    refilled_at: Mapped[float] = mapped_column(Float)  # epoch seconds
    in_flight: Mapped[int] = mapped_column(Integer)


class AuthFailure(Base):
    """One failed authentication from a client address, shared by every gateway: the failed-auth
    limit counts an address's rows of the last minute (older ones are pruned)."""

    __tablename__ = "auth_failures"
    __table_args__ = (Index("ix_auth_failures_address_failed_at", "address", "failed_at"),)

    id: Mapped[int] = mapped_column(AutoId, primary_key=True, autoincrement=True)
    address: Mapped[str] = mapped_column(String(128))
    failed_at: Mapped[float] = mapped_column(Float, index=True)  # epoch seconds


class Price(Base):
    __tablename__ = "prices"
    __table_args__ = (UniqueConstraint("model", "effective_from"),)

    id: Mapped[int] = mapped_column(AutoId, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(100))
    input_per_million: Mapped[int] = mapped_column(BigInteger)
    cached_input_per_million: Mapped[int] = mapped_column(BigInteger)
    output_per_million: Mapped[int] = mapped_column(BigInteger)
    currency: Mapped[str] = mapped_column(String(3))
    effective_from: Mapped[datetime] = mapped_column(UtcDateTime)
    # Batch lines cost this many percent less (migration 0007).
    batch_discount_percent: Mapped[int] = mapped_column(Integer, server_default="0")


class AuditEntry(Base):
    """Admin mutations; rows are never updated or deleted (triggers refuse it)."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(AutoId, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UtcDateTime, index=True)
    actor: Mapped[str] = mapped_column(String(100))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(200))
    before: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    after: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))


class Setting(Base):
    """Server-side secrets and settings (admin token hash, key HMAC secret)."""

    __tablename__ = "settings"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class ConsoleSessionRow(Base):
    """A console sign-in. Only the SHA-256 of its random id is kept, so a copy of the table
    cannot be replayed as a cookie; ``admin_binding`` ties it to the admin token it began under."""

    __tablename__ = "console_sessions"

    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)  # hex SHA-256
    admin_binding: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    expires_at: Mapped[datetime] = mapped_column(UtcDateTime, index=True)


class PublicPrefixRow(Base):
    """A prefix published for every tenant to reuse. Unpublishing keeps the row (its history)
    and sets ``unpublished_at``; a text is published at most once at a time."""

    __tablename__ = "public_prefixes"
    __table_args__ = (
        Index(
            "uq_public_prefixes_live_text",
            "text_sha256",
            unique=True,
            sqlite_where=sql_text("unpublished_at IS NULL"),
            postgresql_where=sql_text("unpublished_at IS NULL"),
        ),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    text: Mapped[str] = mapped_column(Text)
    text_sha256: Mapped[str] = mapped_column(String(64))  # hex SHA-256 of the UTF-8 text
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, index=True)
    created_by: Mapped[str] = mapped_column(String(100))
    unpublished_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    unpublished_by: Mapped[str | None] = mapped_column(String(100))


class BatchFile(Base):
    """A tenant's uploaded batch input, or a batch's output or error file (bytes kept here)."""

    __tablename__ = "batch_files"
    __table_args__ = (Index("ix_batch_files_tenant_id_created_at", "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(32))
    purpose: Mapped[str] = mapped_column(String(16))  # batch | batch_output
    filename: Mapped[str] = mapped_column(String(255))
    num_bytes: Mapped[int] = mapped_column(BigInteger)
    num_lines: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    content: Mapped[bytes] = mapped_column(LargeBinary)


class BatchRow(Base):
    """A batch job; its lines are ``BatchLineRow``s and its counts are counted from them."""

    __tablename__ = "batches"
    __table_args__ = (
        Index("ix_batches_tenant_id_created_at", "tenant_id", "created_at"),
        Index("ix_batches_status", "status"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(32))
    key_id: Mapped[str | None] = mapped_column(String(32))  # the key that created it runs it
    endpoint: Mapped[str] = mapped_column(String(40))
    input_file_id: Mapped[str] = mapped_column(String(40))
    completion_window: Mapped[str] = mapped_column(String(8))
    status: Mapped[str] = mapped_column(String(16))
    output_file_id: Mapped[str | None] = mapped_column(String(40))
    error_file_id: Mapped[str | None] = mapped_column(String(40))
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON(none_as_null=True))
    batch_metadata: Mapped[dict[str, str] | None] = mapped_column(JSON(none_as_null=True))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    expires_at: Mapped[datetime] = mapped_column(UtcDateTime)
    in_progress_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    finalizing_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    completed_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    failed_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    expired_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    cancelling_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    cancelled_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    # The gateway finalizing it (a gateway lease); another takes over once that lease expires.
    lease_id: Mapped[str | None] = mapped_column(String(32))


class BatchLineRow(Base):
    """One request of a batch: ``pending`` → ``running`` (claimed by a gateway lease) →
    ``completed`` | ``failed``; a claim whose lease expired is taken again."""

    __tablename__ = "batch_lines"
    __table_args__ = (
        UniqueConstraint("batch_id", "custom_id"),
        Index("ix_batch_lines_status_batch_id", "status", "batch_id"),
    )

    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id"), primary_key=True)
    line: Mapped[int] = mapped_column(Integer, primary_key=True)
    custom_id: Mapped[str] = mapped_column(String(64))
    body: Mapped[str] = mapped_column(Text)  # the line's request body, JSON
    status: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer)
    lease_id: Mapped[str | None] = mapped_column(String(32))
    not_before: Mapped[datetime | None] = mapped_column(UtcDateTime)  # a quota said wait
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    finished_at: Mapped[datetime | None] = mapped_column(UtcDateTime)


class LoraAdapterRow(Base):
    """A LoRA adapter the server may load from ``path`` (a PEFT folder on the engine's disk),
    usable by one tenant, or by every tenant when ``tenant_id`` is null. Its name is what
    requests put in ``model``, unique on the server."""

    __tablename__ = "lora_adapters"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    path: Mapped[str] = mapped_column(Text)
    tenant_id: Mapped[str | None] = mapped_column(ForeignKey("tenants.id"), index=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    created_by: Mapped[str] = mapped_column(String(100))
    # The served model it rides on (migration 0013); None: the first served model.
    base_model: Mapped[str | None] = mapped_column(String(128))
