"""What the training activities tell the trackers (MLflow, wandb): a run prepared, a
step recorded, a run finished or released. One line in each activity calls here.

Everything is handed to the tracking thread (`ratchet.tracking.dispatch`) and nothing
raises: a tracker that is slow, down or misconfigured costs a warning in the worker's log,
never a training step; `metrics.jsonl` stays the record. `RATCHET_TRACKING=0` in a worker's
environment turns tracking off in that process (benchmarks).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

from ratchet import types as t

log = logging.getLogger(__name__)

# How long finish_run waits for the trackers to take the last points and the summary.
FINISH_WAIT_S = 60.0


def _enabled() -> bool:
    return os.environ.get("RATCHET_TRACKING", "1").strip().lower() not in ("0", "false", "off", "no")


def _hand_over(what: str, fn: Callable[[Any], None]) -> None:
    if not _enabled():
        return
    try:
        from ratchet.tracking.dispatch import DISPATCHER

        DISPATCHER.submit(fn)
    except Exception as exc:  # noqa: BLE001 - tracking never fails an activity
        log.warning("tracking: could not hand over %s: %s: %s", what, type(exc).__name__, exc)


def _opener(run_id: str, run_uri: str, config: dict | None = None, lineage: t.RunLineage | None = None):
    from ratchet.tracking import RunTracking

    return lambda: RunTracking.open(run_id, run_uri, config=config, lineage=lineage)


def run_prepared(inp: t.PrepareInput, run_uri: str, config: dict) -> None:
    """Open (or continue) the run's tracker runs and log its config. A resume prepares the
    run again: the trackers are reopened with the stored config, on the same tracker runs."""

    def call(d) -> None:
        d.drop(inp.run_id)
        d.get(inp.run_id, _opener(inp.run_id, run_uri, config, inp.lineage))

    _hand_over(f"run {inp.run_id} prepared", call)


def step_recorded(inp: t.StepRecord) -> None:
    """Log the step's metrics line (once: a retried step is skipped by step number)."""
    record = {**inp.metrics, "time_unix": time.time()}
    run = inp.run
    _hand_over(
        f"run {run.run_id} step {inp.step}", lambda d: d.get(run.run_id, _opener(run.run_id, run.run_uri)).log_step(inp.step, record)
    )


def run_finished(inp: t.FinishInput) -> None:
    """Catch the trackers up with metrics.jsonl, log the final summary and close the tracker
    runs; waits (at most FINISH_WAIT_S) so they are complete when the run is."""
    if not _enabled():
        return
    run = inp.run

    def call(d) -> None:
        from ratchet.storage.metrics_log import MetricsLog
        from ratchet.storage.object_store import ObjectStore
        from ratchet.tracking import summarize

        tracking = d.get(run.run_id, _opener(run.run_id, run.run_uri))
        tracking.finish(summarize(MetricsLog(ObjectStore(run.run_uri)).read()))
        d.drop(run.run_id)

    _hand_over(f"run {run.run_id} finished", call)
    try:
        from ratchet.tracking.dispatch import DISPATCHER

        if not DISPATCHER.flush(FINISH_WAIT_S):
            log.warning("run %s: the trackers did not finish within %.0f s; they carry on in the background", run.run_id, FINISH_WAIT_S)
    except Exception as exc:  # noqa: BLE001
        log.warning("tracking: %s: %s", type(exc).__name__, exc)


def run_released(inp: t.ReleaseInput) -> None:
    """The run ended without finishing (release_run runs on failure and cancellation, and
    for a run stopped while queued): its tracker runs open in this process are closed,
    marked failed unless it was stopped. (Another process's are not reopened for it: the
    input names no run folder.)"""
    failed = inp.reason != "stopped"
    _hand_over(f"run {inp.run_id} released", lambda d: d.drop(inp.run_id, failed=failed))
