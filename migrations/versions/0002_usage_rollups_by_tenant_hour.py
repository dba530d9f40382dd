"""Covering index of the usage report: rollups by tenant and hour, with the summed counts.

The admin usage query then reads the index alone, in (tenant, hour) order, for one tenant or all.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None

INDEX = "ix_usage_rollups_tenant_id_hour"
TABLE = "usage_rollups"
SUMS = ["requests", "prompt_tokens", "cached_tokens", "completion_tokens"]


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        # Sums as INCLUDE payload: they widen the leaf pages but never the search key.
        op.create_index(INDEX, TABLE, ["tenant_id", "hour"], postgresql_include=SUMS)
    else:
        # SQLite has no INCLUDE; trailing key columns make the index covering all the same.
        op.create_index(INDEX, TABLE, ["tenant_id", "hour", *SUMS])


def downgrade() -> None:
    op.drop_index(INDEX, table_name=TABLE)
