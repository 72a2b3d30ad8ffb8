"""The first schema: runs, checkpoints, sweeps, trials.

Revision ID: 0001_initial
Revises:
Create Date: 2026-12-01 23:34:38.732678
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "checkpoints",
        sa.Column("run_id", sa.String(length=200), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "name"),
    )
    op.create_table(
        "runs",
        sa.Column("run_id", sa.String(length=200), nullable=False),
        sa.Column("name", sa.String(length=500), nullable=False),
        sa.Column("experiment", sa.String(length=500), nullable=False),
        sa.Column("algorithm", sa.String(length=100), nullable=False),
        sa.Column("loop_mode", sa.String(length=50), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("config_digest", sa.String(length=100), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_step", sa.Integer(), nullable=True),
        sa.Column("last_reward", sa.Float(), nullable=True),
        sa.Column("eval_reward", sa.Float(), nullable=True),
        sa.Column("final_metrics", sa.JSON(), nullable=True),
        sa.Column("parent_run_id", sa.String(length=200), nullable=True),
        sa.Column("parent_checkpoint", sa.String(length=200), nullable=True),
        sa.Column("sweep_id", sa.String(length=200), nullable=True),
        sa.Column("trial_index", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("run_id"),
    )
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_runs_experiment"), ["experiment"], unique=False)
        batch_op.create_index(batch_op.f("ix_runs_parent_run_id"), ["parent_run_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_runs_status"), ["status"], unique=False)
        batch_op.create_index(batch_op.f("ix_runs_sweep_id"), ["sweep_id"], unique=False)

    op.create_table(
        "sweeps",
        sa.Column("sweep_id", sa.String(length=200), nullable=False),
        sa.Column("name", sa.String(length=500), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("objective", sa.String(length=200), nullable=False),
        sa.Column("direction", sa.String(length=10), nullable=False),
        sa.Column("best_trial_index", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("sweep_id"),
    )
    op.create_table(
        "trials",
        sa.Column("sweep_id", sa.String(length=200), nullable=False),
        sa.Column("trial_index", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(length=200), nullable=True),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.Column("objective_value", sa.Float(), nullable=True),
        sa.Column("last_reported_step", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("sweep_id", "trial_index"),
    )
    with op.batch_alter_table("trials", schema=None) as batch_op:
        batch_op.create_index("ix_trials_run_id", ["run_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("trials", schema=None) as batch_op:
        batch_op.drop_index("ix_trials_run_id")

    op.drop_table("trials")
    op.drop_table("sweeps")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_runs_sweep_id"))
        batch_op.drop_index(batch_op.f("ix_runs_status"))
        batch_op.drop_index(batch_op.f("ix_runs_parent_run_id"))
        batch_op.drop_index(batch_op.f("ix_runs_experiment"))

    op.drop_table("runs")
    op.drop_table("checkpoints")
