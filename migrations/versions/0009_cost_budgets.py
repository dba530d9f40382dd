"""Monthly budgets in money: the tenant's limit, and what each month and request hold of it.

Amounts are integer micro-units of the price table's currency.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("monthly_cost_budget", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("token_budgets", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("cost_used", sa.BigInteger(), nullable=False, server_default="0")
        )
        batch_op.add_column(
            sa.Column("cost_reserved", sa.BigInteger(), nullable=False, server_default="0")
        )
    with op.batch_alter_table("reservations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("cost", sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("reservations", schema=None) as batch_op:
        batch_op.drop_column("cost")
    with op.batch_alter_table("token_budgets", schema=None) as batch_op:
        batch_op.drop_column("cost_reserved")
        batch_op.drop_column("cost_used")
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.drop_column("monthly_cost_budget")
