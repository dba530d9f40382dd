"""Batch API: uploaded files, batches and their lines; batch lines metered at a batch price.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "batch_files",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("purpose", sa.String(length=16), nullable=False),
        sa.Column("filename", sa.String(length=255), nullable=False),
        sa.Column("num_bytes", sa.BigInteger(), nullable=False),
        sa.Column("num_lines", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batch_files")),
    )
    op.create_index(
        "ix_batch_files_tenant_id_created_at", "batch_files", ["tenant_id", "created_at"]
    )
    op.create_table(
        "batches",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("key_id", sa.String(length=32), nullable=True),
        sa.Column("endpoint", sa.String(length=40), nullable=False),
        sa.Column("input_file_id", sa.String(length=40), nullable=False),
        sa.Column("completion_window", sa.String(length=8), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("output_file_id", sa.String(length=40), nullable=True),
        sa.Column("error_file_id", sa.String(length=40), nullable=True),
        sa.Column("errors", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("batch_metadata", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
        sa.Column("in_progress_at", sa.DateTime(), nullable=True),
        sa.Column("finalizing_at", sa.DateTime(), nullable=True),
        sa.Column("completed_at", sa.DateTime(), nullable=True),
        sa.Column("failed_at", sa.DateTime(), nullable=True),
        sa.Column("expired_at", sa.DateTime(), nullable=True),
        sa.Column("cancelling_at", sa.DateTime(), nullable=True),
        sa.Column("cancelled_at", sa.DateTime(), nullable=True),
        sa.Column("lease_id", sa.String(length=32), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batches")),
    )
    op.create_index("ix_batches_tenant_id_created_at", "batches", ["tenant_id", "created_at"])
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(length=40), nullable=False),
        sa.Column("line", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.String(length=64), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("lease_id", sa.String(length=32), nullable=True),
        sa.Column("not_before", sa.DateTime(), nullable=True),
        sa.Column("result", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(
            ["batch_id"], ["batches.id"], name=op.f("fk_batch_lines_batch_id_batches")
        ),
        sa.PrimaryKeyConstraint("batch_id", "line", name=op.f("pk_batch_lines")),
        sa.UniqueConstraint("batch_id", "custom_id", name=op.f("uq_batch_lines_batch_id")),
    )
    op.create_index("ix_batch_lines_status_batch_id", "batch_lines", ["status", "batch_id"])
    # Plain ADD COLUMN on both dialects: a table rebuild would drop usage_events' triggers.
    op.add_column("usage_events", sa.Column("batch_id", sa.String(length=40), nullable=True))
    op.add_column(
        "prices",
        sa.Column("batch_discount_percent", sa.Integer(), server_default="0", nullable=False),
    )


def downgrade() -> None:
    with op.batch_alter_table("prices", schema=None) as batch_op:
        batch_op.drop_column("batch_discount_percent")
    # SQLite (3.35+) drops a column in place, keeping usage_events' triggers.
    op.execute("ALTER TABLE usage_events DROP COLUMN batch_id")
    op.drop_index("ix_batch_lines_status_batch_id", table_name="batch_lines")
    op.drop_table("batch_lines")
    op.drop_index("ix_batches_status", table_name="batches")
    op.drop_index("ix_batches_tenant_id_created_at", table_name="batches")
    op.drop_table("batches")
    op.drop_index("ix_batch_files_tenant_id_created_at", table_name="batch_files")
    op.drop_table("batch_files")
