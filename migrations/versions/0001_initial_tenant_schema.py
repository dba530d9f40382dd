"""Initial tenant schema: tenants, keys, usage, budgets, rate buckets, prices, audit, settings.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "audit_log",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("actor", sa.String(length=100), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("target", sa.String(length=200), nullable=False),
        sa.Column("before", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("after", sa.JSON(none_as_null=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
    )
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_audit_log_at"), ["at"], unique=False)

    op.create_table(
        "prices",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("model", sa.String(length=100), nullable=False),
        sa.Column("input_per_million", sa.BigInteger(), nullable=False),
        sa.Column("cached_input_per_million", sa.BigInteger(), nullable=False),
        sa.Column("output_per_million", sa.BigInteger(), nullable=False),
        sa.Column("currency", sa.String(length=3), nullable=False),
        sa.Column("effective_from", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_prices")),
        sa.UniqueConstraint("model", "effective_from", name=op.f("uq_prices_model")),
    )
    op.create_table(
        "settings",
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_settings")),
    )
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("requests_per_minute", sa.BigInteger(), nullable=True),
        sa.Column("tokens_per_minute", sa.BigInteger(), nullable=True),
        sa.Column("max_concurrent_requests", sa.BigInteger(), nullable=True),
        sa.Column("monthly_token_budget", sa.BigInteger(), nullable=True),
        sa.Column("max_prompt_tokens", sa.BigInteger(), nullable=True),
        sa.Column("kv_cache_share", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )
    op.create_table(
        "usage_events",
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("key_id", sa.String(length=32), nullable=True),
        sa.Column("model", sa.String(length=100), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=False),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("duration_ms", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_usage_events")),
    )
    with op.batch_alter_table("usage_events", schema=None) as batch_op:
        batch_op.create_index(
            "ix_usage_events_model_started_at", ["model", "started_at"], unique=False
        )
        batch_op.create_index(
            "ix_usage_events_tenant_id_started_at", ["tenant_id", "started_at"], unique=False
        )

    op.create_table(
        "usage_rollups",
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("model", sa.String(length=100), nullable=False),
        sa.Column("hour", sa.DateTime(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "model", "hour", name=op.f("pk_usage_rollups")),
    )
    with op.batch_alter_table("usage_rollups", schema=None) as batch_op:
        batch_op.create_index("ix_usage_rollups_hour", ["hour"], unique=False)

    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("revoked_at", sa.DateTime(), nullable=True),
        sa.Column("last_used_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_api_keys_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("prefix", name=op.f("uq_api_keys_prefix")),
    )
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_api_keys_tenant_id"), ["tenant_id"], unique=False)

    op.create_table(
        "rate_buckets",
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("requests_drawn", sa.Float(), nullable=False),
        sa.Column("tokens_drawn", sa.Float(), nullable=False),
        sa.Column("refilled_at", sa.Float(), nullable=False),
        sa.Column("in_flight", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_rate_buckets_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("tenant_id", name=op.f("pk_rate_buckets")),
    )
    op.create_table(
        "reservations",
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("period", sa.String(length=7), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_reservations_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_reservations")),
    )
    with op.batch_alter_table("reservations", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_reservations_tenant_id"), ["tenant_id"], unique=False)

    op.create_table(
        "token_budgets",
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("period", sa.String(length=7), nullable=False),
        sa.Column("used", sa.BigInteger(), nullable=False),
        sa.Column("reserved", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_token_budgets_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("tenant_id", "period", name=op.f("pk_token_budgets")),
    )

    _create_append_only_triggers()


def downgrade() -> None:
    _drop_append_only_triggers()
    op.drop_table("token_budgets")
    with op.batch_alter_table("reservations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_reservations_tenant_id"))

    op.drop_table("reservations")
    op.drop_table("rate_buckets")
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_api_keys_tenant_id"))

    op.drop_table("api_keys")
    with op.batch_alter_table("usage_rollups", schema=None) as batch_op:
        batch_op.drop_index("ix_usage_rollups_hour")

    op.drop_table("usage_rollups")
    with op.batch_alter_table("usage_events", schema=None) as batch_op:
        batch_op.drop_index("ix_usage_events_tenant_id_started_at")
        batch_op.drop_index("ix_usage_events_model_started_at")

    op.drop_table("usage_events")
    op.drop_table("tenants")
    op.drop_table("settings")
    op.drop_table("prices")
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_audit_log_at"))

    op.drop_table("audit_log")


# Audit rows and usage events are append-only: the database itself refuses UPDATE and DELETE.
APPEND_ONLY = ("audit_log", "usage_events")


def _create_append_only_triggers() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        op.execute(
            "CREATE FUNCTION atrium_append_only() RETURNS trigger LANGUAGE plpgsql AS $$ "
            "BEGIN RAISE EXCEPTION '% is append-only', TG_TABLE_NAME; END $$"
        )
    for table in APPEND_ONLY:
        for verb in ("UPDATE", "DELETE"):
            name = f"{table}_no_{verb.lower()}"
            if dialect == "postgresql":
                op.execute(
                    f"CREATE TRIGGER {name} BEFORE {verb} ON {table} "
                    "FOR EACH ROW EXECUTE FUNCTION atrium_append_only()"
                )
            elif dialect == "sqlite":
                op.execute(
                    f"CREATE TRIGGER {name} BEFORE {verb} ON {table} "
                    f"BEGIN SELECT RAISE(ABORT, '{table} is append-only'); END"
                )


def _drop_append_only_triggers() -> None:
    dialect = op.get_bind().dialect.name
    for table in APPEND_ONLY:
        for verb in ("update", "delete"):
            if dialect == "postgresql":
                op.execute(f"DROP TRIGGER IF EXISTS {table}_no_{verb} ON {table}")
            elif dialect == "sqlite":
                op.execute(f"DROP TRIGGER IF EXISTS {table}_no_{verb}")
    if dialect == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS atrium_append_only()")
