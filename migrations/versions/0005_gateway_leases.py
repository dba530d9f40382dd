"""Gateway leases, and reservations as started records owned by a lease.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "gateway_leases",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gateway_leases")),
    )
    with op.batch_alter_table("gateway_leases", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_gateway_leases_expires_at"), ["expires_at"], unique=False
        )
    # Reservations made before this revision have no lease: reclaimed once old enough.
    with op.batch_alter_table("reservations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("lease_id", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("key_id", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("model", sa.String(length=100), nullable=True))
        batch_op.add_column(
            sa.Column("prompt_tokens", sa.BigInteger(), nullable=False, server_default="0")
        )
        batch_op.create_index(batch_op.f("ix_reservations_lease_id"), ["lease_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("reservations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_reservations_lease_id"))
        for column in ("prompt_tokens", "model", "key_id", "lease_id"):
            batch_op.drop_column(column)
    with op.batch_alter_table("gateway_leases", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_gateway_leases_expires_at"))
    op.drop_table("gateway_leases")
