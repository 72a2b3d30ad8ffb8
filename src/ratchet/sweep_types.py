"""Messages of the sweep workflow: its input, its activities' inputs and outputs, what its
queries and its result carry back.

Standard library only (plus `ratchet.types`), like `src/ratchet/types.py`, so the workflow
imports it inside Temporal's sandbox. Small: configs as plain JSON, params as scalars.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ratchet.types import LoopPlan, TrainingInput

TRIAL_STATES = ("pending", "running", "completed", "pruned", "failed", "cancelled")


def trial_run_id(sweep_id: str, index: int) -> str:
    """Trial `index`'s run id, which is also its child workflow id: deterministic, so a
    replayed or retried start finds the trial that already runs instead of a second one."""
    return f"{sweep_id}-t{index}"


@dataclass
class SweepPlan:
    """What the workflow needs of the spec to schedule trials (derived by the client)."""

    trials: int
    parallelism: int
    direction: str = "max"  # max | min
    stop_rule: str = "none"  # none | median | asha
    rungs: list[int] = field(default_factory=list)
    eta: int = 3
    min_trials: int = 1
    poll_seconds: float = 5.0
    stop_direction: str = ""  # max | min for the rung metric; "": the objective's direction


@dataclass
class SweepInput:
    sweep_id: str
    spec: dict[str, Any]  # the validated SweepSpec as JSON
    base_config: dict[str, Any]  # the base run config with its overrides, validated, paths absolute
    plan: SweepPlan
    # The namespace has ratchet's search attributes (checked by the client): trials start
    # with theirs, and their TrainingInput tells them to upsert as they go.
    search_attributes: bool = False


@dataclass
class SweepBeginInput:
    sweep_id: str
    spec: dict[str, Any]


@dataclass
class PlanTrialInput:
    sweep_id: str
    spec: dict[str, Any]
    base_config: dict[str, Any]
    trial_index: int


@dataclass
class TrialPlan:
    """Trial k's values, its validated config and loop plan: a child workflow's input."""

    trial_index: int
    run_id: str
    params: dict[str, Any]
    config: dict[str, Any]
    plan: LoopPlan
    storage_root: str


@dataclass
class TrialWatch:
    trial_index: int
    run_id: str
    storage_root: str
    rungs_seen: int = 0  # rungs already reported for it: only newer ones are read


@dataclass
class RungInput:
    trials: list[TrialWatch]
    rungs: list[int]
    metric: str
    window: int = 1
    # The activity waits (heartbeating) until a trial reaches a new rung, reading the
    # metrics every poll_seconds, for at most max_wait_seconds: one activity per rung
    # reached, not one per poll, in the sweep's history.
    poll_seconds: float = 1.0
    max_wait_seconds: float = 60.0


@dataclass
class RungReport:
    trial_index: int
    steps: int  # steps recorded so far
    values: list[float | None] = field(default_factory=list)  # the metric at rungs[rungs_seen:], as far as reached (None: not logged there)


@dataclass
class FinishTrialInput:
    sweep_id: str
    spec: dict[str, Any]
    trial_index: int
    run_id: str
    storage_root: str
    params: dict[str, Any]
    state: str  # completed | pruned | failed | cancelled
    steps: int = 0
    eval_rewards: dict[str, float] = field(default_factory=dict)
    pruned_at: int | None = None
    error: str = ""


@dataclass
class TrialResult:
    trial_index: int
    run_id: str
    state: str
    params: dict[str, Any] = field(default_factory=dict)
    objective: float | None = None
    steps: int = 0
    pruned_at: int | None = None  # the rung it was stopped at
    error: str = ""


@dataclass
class SweepEndInput:
    sweep_id: str
    status: str  # completed | cancelled | failed
    best_trial_index: int | None = None


@dataclass
class SweepProgress:
    """What the sweep's `progress` query returns."""

    sweep_id: str
    status: str  # running | paused | cancelling | completed | cancelled
    total: int
    started: int
    running: list[int] = field(default_factory=list)
    finished: list[TrialResult] = field(default_factory=list)
    best: TrialResult | None = None
    rung_values: dict[str, dict[str, float]] = field(default_factory=dict)  # rung -> trial -> value


@dataclass
class SweepSummary:
    """The sweep workflow's result."""

    sweep_id: str
    status: str  # completed | cancelled
    trials: list[TrialResult] = field(default_factory=list)
    best: TrialResult | None = None


@dataclass
class LaunchInput:
    """A Temporal Schedule's action: start one run or one sweep, named after the schedule
    and the time it fired (the same input every time; the ids are made at launch)."""

    schedule_id: str
    kind: str  # run | sweep
    training: TrainingInput | None = None  # (kind "run"); its run_id is replaced at launch
    sweep: SweepInput | None = None  # (kind "sweep"); its sweep_id is replaced at launch


@dataclass
class LaunchOutput:
    workflow_id: str
    result: dict[str, Any] = field(default_factory=dict)
