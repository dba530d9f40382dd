"""LoRA adapters: registered by the admin for one tenant or for all.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "lora_adapters",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("created_by", sa.String(length=100), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_lora_adapters_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_lora_adapters")),
        sa.UniqueConstraint("name", name=op.f("uq_lora_adapters_name")),
    )
    with op.batch_alter_table("lora_adapters", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_lora_adapters_tenant_id"), ["tenant_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("lora_adapters", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_lora_adapters_tenant_id"))
    op.drop_table("lora_adapters")
