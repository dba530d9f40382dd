"""Covering indexes of the usage report: rollups by (hour, tenant) and by (tenant, hour).

With the summed counts in the index, the admin usage query reads an index alone and in group
order: by hour then tenant for all tenants, by hour within one tenant for a single one.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None

TABLE = "usage_rollups"
SUMS = ["requests", "prompt_tokens", "cached_tokens", "completion_tokens"]
INDEXES = {
    "ix_usage_rollups_hour_tenant_id": ["hour", "tenant_id"],
    "ix_usage_rollups_tenant_id_hour": ["tenant_id", "hour"],
}


def upgrade() -> None:
    postgresql = op.get_bind().dialect.name == "postgresql"
    for name, keys in INDEXES.items():
        if postgresql:
            # The sums as INCLUDE payload: carried in the leaves, never part of the search key.
            op.create_index(name, TABLE, keys, postgresql_include=SUMS)
        else:
            # SQLite has no INCLUDE; trailing key columns make the index covering all the same.
            op.create_index(name, TABLE, [*keys, *SUMS])


def downgrade() -> None:
    for name in INDEXES:
        op.drop_index(name, table_name=TABLE)
