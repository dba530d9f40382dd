"""Failed authentications by client address, so every gateway counts an address's failures
against one limit (a table of the last minute's failures; older rows are pruned as new ones come).

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "auth_failures",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("address", sa.String(length=128), nullable=False),
        sa.Column("failed_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_auth_failures")),
    )
    with op.batch_alter_table("auth_failures", schema=None) as batch_op:
        batch_op.create_index(
            "ix_auth_failures_address_failed_at", ["address", "failed_at"], unique=False
        )
        batch_op.create_index(batch_op.f("ix_auth_failures_failed_at"), ["failed_at"], unique=False)


def downgrade() -> None:
    op.drop_table("auth_failures")
