"""The registry's tables as SQLAlchemy 2 ORM models.

The Alembic revisions in `migrations/versions/` create exactly these; a change here needs a
new revision (`tests/registry/test_migrations.py` compares the migrated schema with these
models). Timestamps are stored as timezone-aware UTC where the database keeps zones
(PostgreSQL) and as naive UTC in SQLite; the registry hands out aware UTC either way.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, DateTime, Float, Index, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

ID = String(200)


class Base(DeclarativeBase):
    pass


class Run(Base):
    __tablename__ = "runs"

    run_id: Mapped[str] = mapped_column(ID, primary_key=True)
    name: Mapped[str] = mapped_column(String(500), default="")
    experiment: Mapped[str] = mapped_column(String(500), default="", index=True)
    algorithm: Mapped[str] = mapped_column(String(100), default="")
    loop_mode: Mapped[str] = mapped_column(String(50), default="")
    model: Mapped[str] = mapped_column(Text, default="")
    config_digest: Mapped[str] = mapped_column(String(100), default="")
    config: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    status: Mapped[str] = mapped_column(String(20), default="running", index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    last_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_reward: Mapped[float | None] = mapped_column(Float, nullable=True)
    eval_reward: Mapped[float | None] = mapped_column(Float, nullable=True)
    final_metrics: Mapped[dict[str, float] | None] = mapped_column(JSON, nullable=True)
    parent_run_id: Mapped[str | None] = mapped_column(ID, nullable=True, index=True)
    parent_checkpoint: Mapped[str | None] = mapped_column(String(200), nullable=True)
    sweep_id: Mapped[str | None] = mapped_column(ID, nullable=True, index=True)
    trial_index: Mapped[int | None] = mapped_column(Integer, nullable=True)


class Checkpoint(Base):
    __tablename__ = "checkpoints"

    # (run_id, name) is the key: a retried checkpoint activity writes the same row again.
    run_id: Mapped[str] = mapped_column(ID, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    step: Mapped[int] = mapped_column(Integer)
    uri: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Sweep(Base):
    __tablename__ = "sweeps"

    sweep_id: Mapped[str] = mapped_column(ID, primary_key=True)
    name: Mapped[str] = mapped_column(String(500), default="")
    spec: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    status: Mapped[str] = mapped_column(String(20), default="running")
    objective: Mapped[str] = mapped_column(String(200), default="")
    direction: Mapped[str] = mapped_column(String(10), default="maximize")
    best_trial_index: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Trial(Base):
    __tablename__ = "trials"

    # No foreign keys to runs or sweeps: the sweep workflow may record a trial before its
    # run exists (pending) and the registry can be rebuilt table by table.
    sweep_id: Mapped[str] = mapped_column(ID, primary_key=True)
    trial_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str | None] = mapped_column(ID, nullable=True)
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    state: Mapped[str] = mapped_column(String(20), default="pending")
    objective_value: Mapped[float | None] = mapped_column(Float, nullable=True)
    last_reported_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))

    __table_args__ = (Index("ix_trials_run_id", "run_id"),)


__all__ = ["Base", "Checkpoint", "Run", "Sweep", "Trial"]
