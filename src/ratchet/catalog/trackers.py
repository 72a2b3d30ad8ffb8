"""Every tracker backend a run can mirror its metrics into, by name: the one table a new
backend is added to (docs/architecture.md, "A tracker").

An entry names the backend's builder as a "module:function" string, so this table (and
the config layer beside it) imports neither MLflow nor wandb: each takes seconds to
import, and is imported only in the process that builds a backend a run turned on. The
builder takes the run's typed `tracking` section and returns a `Tracker` (base.py);
`enabled` reads the section's switch for the backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .registry import Registry, resolve

if TYPE_CHECKING:
    from ratchet.config.schema import TrackingConfig

    from ratchet.tracking.base import Tracker


@dataclass(frozen=True)
class TrackerEntry:
    build: str  # "module:function", function(TrackingConfig) -> Tracker
    enabled: Callable[["TrackingConfig"], bool]
    description: str

    def builder(self) -> Callable[["TrackingConfig"], "Tracker"]:
        return resolve(self.build)


TRACKERS: Registry[TrackerEntry] = Registry("tracker")
TRACKERS.register(
    "mlflow",
    TrackerEntry("ratchet.tracking.mlflow_tracker:from_config", lambda t: t.mlflow, "MLflow: on by default, a local SQLite store"),
)
TRACKERS.register(
    "wandb",
    TrackerEntry("ratchet.tracking.wandb_tracker:from_config", lambda t: t.wandb.enabled, "wandb: off by default, offline unless asked"),
)
