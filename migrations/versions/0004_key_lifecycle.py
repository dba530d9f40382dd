"""Key lifecycle: expiry, rotation successor, scopes, model list and a per-key rate limit.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None

# Keys issued before this revision keep doing everything they did.
DEFAULT_SCOPES = "inference usage:read"


def upgrade() -> None:
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.add_column(sa.Column("expires_at", sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column("replaced_by", sa.String(length=32), nullable=True))
        batch_op.add_column(
            sa.Column(
                "scopes",
                sa.String(length=100),
                nullable=False,
                server_default=DEFAULT_SCOPES,
            )
        )
        batch_op.add_column(sa.Column("models", sa.JSON(none_as_null=True), nullable=True))
        batch_op.add_column(sa.Column("requests_per_minute", sa.BigInteger(), nullable=True))
    op.create_table(
        "key_rate_buckets",
        sa.Column("key_id", sa.String(length=32), nullable=False),
        sa.Column("requests_drawn", sa.Float(), nullable=False),
        sa.Column("refilled_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["key_id"], ["api_keys.id"], name=op.f("fk_key_rate_buckets_key_id_api_keys")
        ),
        sa.PrimaryKeyConstraint("key_id", name=op.f("pk_key_rate_buckets")),
    )


def downgrade() -> None:
    op.drop_table("key_rate_buckets")
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        for column in ("requests_per_minute", "models", "scopes", "replaced_by", "expires_at"):
            batch_op.drop_column(column)
