"""Output tokens delivered so far, checkpointed on the reservation by the gateway serving it, so
a reclaimer settling a dead gateway's request bills them (not the prompt alone).

Expand only: a defaulted column that the previous release neither reads nor writes.

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("reservations", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("completion_tokens", sa.BigInteger(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("reservations", schema=None) as batch_op:
        batch_op.drop_column("completion_tokens")
