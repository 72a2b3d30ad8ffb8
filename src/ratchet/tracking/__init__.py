"""Experiment trackers: a run's metrics mirrored into MLflow (on by default, a local
store) and wandb (when configured, offline by default).

`Tracker` (base.py) is what a backend fulfils; `mlflow_tracker.py` and `wandb_tracker.py`
are the two backends, listed by name in `ratchet/catalog/trackers.py` (where a new one is added);
`session.RunTracking` holds one run's backends in a process and
continues their runs from the run folder's `tracking.json`; `dispatch.DISPATCHER` does
the work on one background thread so that no training step waits for a tracker. The
activities call it through `src/ratchet/activities/tracking_calls.py`. MLflow and wandb are
imported only when a backend is built.
"""

from __future__ import annotations

from .base import RunInfo, Tracker, numeric_metrics
from .session import TRACKING_KEY, RunTracking, summarize
from .uris import default_mlflow_uri, mlflow_uri, redact

__all__ = [
    "TRACKING_KEY",
    "RunInfo",
    "RunTracking",
    "Tracker",
    "default_mlflow_uri",
    "mlflow_uri",
    "numeric_metrics",
    "redact",
    "summarize",
]
