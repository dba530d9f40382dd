"""The served model a LoRA adapter rides on, named at registration.

Expand only: a nullable column the previous release neither reads nor writes; a null (its rows
and those it registers) means the first served model, as before.

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("lora_adapters", schema=None) as batch_op:
        batch_op.add_column(sa.Column("base_model", sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("lora_adapters", schema=None) as batch_op:
        batch_op.drop_column("base_model")
