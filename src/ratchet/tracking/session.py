"""A ratchet run's trackers in one process: opened once, continued from the run folder's
`tracking.json`, each point logged once.

`RunTracking.open` builds the backends the run's config asks for, opens (or continues)
each one's run and writes what continues it to `<run>/tracking.json`, so that any later
worker process, after a resume or a recovery, appends to the same tracker runs.

Each backend remembers the last step it holds (`Tracker.last_step`, asked once when it is
opened); a step at or below it is not logged again, so a retried `record_step` adds no
duplicate point. What a backend misses (it was down, the process died with points
queued) is caught up from `metrics.jsonl`, the record, when the backend is next opened or
comes back. A backend that raises is left alone for `RETRY_AFTER_S` and never fails the
caller: the failure is a warning.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Sequence

from ratchet.config.schema import TrackingConfig
from ratchet.storage.metrics_log import MetricsLog
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.layout import RunLayout
from ratchet.types import RunLineage

from .base import RunInfo, Tracker, numeric_metrics
from ratchet.catalog.trackers import TRACKERS
from .uris import redact

log = logging.getLogger(__name__)

TRACKING_KEY = RunLayout.TRACKING  # in the run folder, next to metrics.jsonl
FORMAT = "ratchet-tracking/1"
RETRY_AFTER_S = 60.0


def build_trackers(tracking: TrackingConfig) -> list[tuple[str, Callable[[], Tracker]]]:
    """(name, factory) of the backends the `tracking` section turns on (ratchet/catalog/trackers.py)."""
    out: list[tuple[str, Callable[[], Tracker]]] = []
    for name in TRACKERS.names():
        entry = TRACKERS.get(name)
        if entry.enabled(tracking):
            out.append((name, functools.partial(entry.builder(), tracking)))
    return out


def tracking_section(config: Mapping[str, Any]) -> TrackingConfig:
    """The typed `tracking` section of a stored run config (a plain mapping, as stored)."""
    return TrackingConfig.model_validate(config.get("tracking", {}))


@dataclass
class _Slot:
    make: Callable[[], Tracker]
    name: str
    tracker: Tracker | None = None
    last: int | None = None
    retry_after: float = 0.0  # monotonic time; 0: healthy


class RunTracking:
    """The trackers of one run in this process (see the module docstring)."""

    def __init__(self, run: RunInfo, store: ObjectStore, backends: list[tuple[str, Callable[[], Tracker]]], clock=time.monotonic):
        self.run, self.store, self.clock = run, store, clock
        self.slots = [_Slot(make, name) for name, make in backends]
        self.saved: dict[str, Any] = {}
        self.config: dict[str, Any] = {}

    @classmethod
    def open(
        cls, run_id: str, run_uri: str, *, config: Mapping[str, Any] | None = None, lineage: RunLineage | None = None, clock=time.monotonic
    ) -> "RunTracking":
        store = ObjectStore(run_uri)
        config = dict(config) if config is not None else store.get_json(RunLayout.CONFIG)
        saved = store.get_json(TRACKING_KEY) if store.exists(TRACKING_KEY) else {}
        if lineage is None or lineage == RunLineage():
            lineage = RunLineage(**saved.get("lineage", {}))
        tracking = tracking_section(config)
        run = RunInfo(run_id, run_uri, tracking.experiment, tracking.name, tuple(tracking.tags), lineage)
        self = cls(run, store, build_trackers(tracking), clock=clock)
        self.saved = {**saved, "format": FORMAT, "run_id": run_id, "lineage": asdict(lineage)}
        self.config = config
        return self

    @property
    def active(self) -> list[str]:
        return [s.name for s in self.slots if s.tracker is not None]

    # -- opening, with failures kept off the caller -----------------------------------

    def _guard(self, slot: _Slot, what: str, fn: Callable[[], Any]) -> bool:
        try:
            fn()
            return True
        except Exception as exc:  # noqa: BLE001 - a tracker never fails a run
            slot.retry_after = self.clock() + RETRY_AFTER_S
            log.warning(
                "run %s: %s tracker failed to %s (%s: %s); metrics.jsonl has every step, and this tracker is tried "
                "again in %.0f s", self.run.run_id, slot.name, what, type(exc).__name__, redact(str(exc))[:500], RETRY_AFTER_S,
            )  # fmt: skip
            if slot.tracker is not None and what == "open":
                slot.tracker = None
            return False

    def _ready(self, slot: _Slot) -> bool:
        """Open the slot's tracker if it is not (catching it up from metrics.jsonl), unless
        it failed less than RETRY_AFTER_S ago."""
        if slot.retry_after and self.clock() < slot.retry_after:
            return False
        if slot.tracker is None:

            def start() -> None:
                tracker = slot.make()
                self.saved[slot.name] = tracker.start_or_continue(self.run, self.saved.get(slot.name, {}))
                slot.tracker, slot.last = tracker, tracker.last_step()
                self._save()
                tracker.log_config(self.config)

            if not self._guard(slot, "open", start):
                return False
            log.info("run %s: %s tracker open (%s)", self.run.run_id, slot.name, self.saved.get(slot.name))
            slot.retry_after = 0.0
            self._catch_up(slot)
        elif slot.retry_after:
            slot.retry_after = 0.0
            self._catch_up(slot)
        return slot.tracker is not None and not slot.retry_after

    def _save(self) -> None:
        self.store.put_json(TRACKING_KEY, self.saved)

    def _catch_up(self, slot: _Slot) -> None:
        """Log the lines of metrics.jsonl after the tracker's last step."""
        for record in MetricsLog(self.store).read():
            if slot.retry_after:
                return
            self._log(slot, int(record["step"]), numeric_metrics(record), record.get("time_unix"))

    def _log(self, slot: _Slot, step: int, metrics: dict[str, float], time_unix: float | None) -> None:
        if slot.last is not None and step <= slot.last:
            return  # already there: a retried step, or one caught up earlier

        def point() -> None:
            slot.tracker.log_step(step, metrics, time_unix)  # type: ignore[union-attr]
            slot.last = step

        if self._guard(slot, f"log step {step}", point) and slot.tracker.saves_last_step:  # type: ignore[union-attr]
            self.saved[slot.name]["last_step"] = step
            self._save()

    # -- what the activities call ------------------------------------------------------

    def start(self) -> list[str]:
        """Open (or continue) every tracker and log the config; returns those open."""
        for slot in self.slots:
            self._ready(slot)
        return self.active

    def log_step(self, step: int, record: Mapping[str, Any]) -> None:
        metrics = numeric_metrics(record)
        for slot in self.slots:
            if self._ready(slot):
                self._log(slot, step, metrics, record.get("time_unix"))

    def finish(self, summary: Mapping[str, float]) -> None:
        for slot in self.slots:
            if self._ready(slot):
                self._catch_up(slot)  # every line, also those written while it was away
                self._guard(slot, "log the summary", lambda: slot.tracker.log_summary(summary))  # type: ignore[union-attr]

    def close(self, failed: bool = False) -> None:
        for slot in self.slots:
            if slot.tracker is not None:
                tracker, slot.tracker = slot.tracker, None
                self._guard(slot, "close", lambda: tracker.close(failed))


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """A run's final numbers from its metrics.jsonl lines."""
    if not records:
        return {"steps": 0.0}
    rewards = [float(r["reward_mean"]) for r in records if isinstance(r.get("reward_mean"), (int, float))]
    evals = [float(r["eval_reward"]) for r in records if isinstance(r.get("eval_reward"), (int, float))]
    times = [float(r["time_unix"]) for r in records if isinstance(r.get("time_unix"), (int, float))]
    out = {"steps": float(len(records)), "last_step": float(max(int(r["step"]) for r in records))}
    if rewards:
        out["reward_first10"] = sum(rewards[:10]) / len(rewards[:10])
        out["reward_last10"] = sum(rewards[-10:]) / len(rewards[-10:])
    if evals:
        out["eval_reward_last"], out["eval_reward_best"] = evals[-1], max(evals)
    if len(times) > 1:
        out["wall_seconds"] = max(times) - min(times)
    return out
