"""What the run registry hands out and takes in: frozen dataclasses, one per table row.

They are plain values (no SQLAlchemy session behind them), so callers in activities, the
CLI and the sweep code can pass them around, compare them in tests and print them
without holding a database connection open.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

RUN_STATUSES = ("running", "completed", "failed", "cancelled", "stopped")
# A run that ended: `finish_run` may set one of these; "running" is set by `record_run`.
END_STATUSES = ("completed", "failed", "cancelled", "stopped")
SWEEP_STATUSES = ("pending", "running", "paused", "completed", "failed", "cancelled", "stopped")
TRIAL_STATES = ("pending", "running", "completed", "pruned", "failed")
DIRECTIONS = ("maximize", "minimize")


@dataclass(frozen=True)
class RunRecord:
    """One training run. `created_at`/`updated_at` are set by the registry (UTC); values
    given here for them are ignored on write."""

    run_id: str
    name: str = ""
    experiment: str = ""
    algorithm: str = ""
    loop_mode: str = ""
    model: str = ""
    config_digest: str = ""
    config: dict[str, Any] = field(default_factory=dict, hash=False, compare=True)
    status: str = "running"
    created_at: datetime | None = None
    updated_at: datetime | None = None
    last_step: int | None = None
    last_reward: float | None = None
    eval_reward: float | None = None
    final_metrics: dict[str, float] | None = field(default=None, hash=False)
    parent_run_id: str | None = None
    parent_checkpoint: str | None = None
    sweep_id: str | None = None
    trial_index: int | None = None


@dataclass(frozen=True)
class CheckpointRecord:
    """A committed checkpoint of a run (its manifest exists), named as in the run folder."""

    run_id: str
    step: int
    name: str
    uri: str
    created_at: datetime | None = None


@dataclass(frozen=True)
class SweepRecord:
    """A sweep: its spec, what it optimizes and, once known, its best trial."""

    sweep_id: str
    name: str = ""
    spec: dict[str, Any] = field(default_factory=dict, hash=False)
    status: str = "running"
    objective: str = ""
    direction: str = "maximize"
    best_trial_index: int | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None


@dataclass(frozen=True)
class TrialRecord:
    """One trial of a sweep; `run_id` is its training run (None while pending)."""

    sweep_id: str
    trial_index: int
    run_id: str | None = None
    params: dict[str, Any] = field(default_factory=dict, hash=False)
    state: str = "pending"
    objective_value: float | None = None
    last_reported_step: int | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None


__all__ = [
    "DIRECTIONS",
    "END_STATUSES",
    "RUN_STATUSES",
    "SWEEP_STATUSES",
    "TRIAL_STATES",
    "CheckpointRecord",
    "RunRecord",
    "SweepRecord",
    "TrialRecord",
]
