"""Public prefixes: published for every tenant, kept across restarts.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | None = None
depends_on: str | None = None

LIVE = sa.text("unpublished_at IS NULL")


def upgrade() -> None:
    op.create_table(
        "public_prefixes",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("text_sha256", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("created_by", sa.String(length=100), nullable=False),
        sa.Column("unpublished_at", sa.DateTime(), nullable=True),
        sa.Column("unpublished_by", sa.String(length=100), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_public_prefixes")),
    )
    with op.batch_alter_table("public_prefixes", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_public_prefixes_created_at"), ["created_at"], unique=False
        )
        # One live row per text: publishing the same text twice is a conflict, even in a race.
        batch_op.create_index(
            "uq_public_prefixes_live_text",
            ["text_sha256"],
            unique=True,
            sqlite_where=LIVE,
            postgresql_where=LIVE,
        )


def downgrade() -> None:
    with op.batch_alter_table("public_prefixes", schema=None) as batch_op:
        batch_op.drop_index("uq_public_prefixes_live_text")
        batch_op.drop_index(batch_op.f("ix_public_prefixes_created_at"))
    op.drop_table("public_prefixes")
