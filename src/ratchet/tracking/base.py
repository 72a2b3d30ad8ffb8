"""What every tracker backend fulfils (`Tracker`), and what it is told about a run (`RunInfo`).

A tracker mirrors a run's `metrics.jsonl` into an outside tool (MLflow, wandb). It is a
copy for people to look at, never the record: the run folder stays the source of truth,
so a backend may fail, lag or be switched off without the run noticing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, runtime_checkable

from ratchet.types import RunLineage


@dataclass(frozen=True)
class RunInfo:
    """The run as the trackers name and group it."""

    run_id: str
    run_uri: str
    experiment: str = "default"
    name: str = "run"
    tags: tuple[str, ...] = ()
    lineage: RunLineage = field(default_factory=RunLineage)

    def labels(self) -> dict[str, str]:
        """Tags every backend carries: the run id, where it lives and where it comes from."""
        out = {"ratchet.run_id": self.run_id, "ratchet.run_uri": self.run_uri, "ratchet.name": self.name}
        lin = self.lineage
        for key, value in (
            ("ratchet.sweep_id", lin.sweep_id),
            ("ratchet.trial_index", lin.trial_index),
            ("ratchet.parent_run_id", lin.parent_run_id),
            ("ratchet.parent_checkpoint", lin.parent_checkpoint),
        ):
            if value is not None:
                out[key] = str(value)
        out.update({f"ratchet.tag.{t}": "true" for t in self.tags})
        return out


@runtime_checkable
class Tracker(Protocol):
    """One backend's view of one ratchet run. Calls come in this order: `start_or_continue`
    once per process, then `log_config`, `log_step` (steps increasing), `log_summary`,
    `close`. Raising is allowed anywhere: `RunTracking` logs a warning and carries on."""

    name: str
    # True for a backend that cannot tell the highest step it holds (offline wandb): the
    # session writes `last_step` into the backend's part of tracking.json after every point,
    # and `start_or_continue` finds it again in `saved`.
    saves_last_step: bool

    def start_or_continue(self, run: RunInfo, saved: Mapping[str, Any]) -> dict[str, Any]:
        """Open the backend's run: the one `saved` names (what an earlier call returned,
        kept in the run folder's tracking.json), or a new one. Returns what to keep so
        that a later process continues the same backend run instead of starting another."""
        ...

    def last_step(self) -> int | None:
        """The highest step the backend already holds (None: none, or it cannot tell)."""
        ...

    def log_config(self, config: Mapping[str, Any]) -> None: ...

    def log_step(self, step: int, metrics: Mapping[str, float], time_unix: float | None = None) -> None: ...

    def log_summary(self, summary: Mapping[str, float]) -> None: ...

    def close(self, failed: bool = False) -> None:
        """Let go of the backend's run; `failed`: the ratchet run ended without finishing
        (failed or cancelled), and the backend run is marked so."""
        ...


def numeric_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """The plottable numbers of a metrics.jsonl line: the step and the time stamps are the
    axes, not series; strings and bools are dropped."""
    skip = {"step", "time_unix", "time_utc"}
    return {k: float(v) for k, v in record.items() if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool)}
