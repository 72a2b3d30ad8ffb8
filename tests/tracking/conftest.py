"""Fixtures of the tracking tests: a state folder per test (the default MLflow store and
wandb folder live there), a run folder with a stored config, and a tracking thread of the
test's own, standing for one worker process."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from ratchet import types as t
from ratchet.storage.metrics_log import MetricsLog
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.layout import RunLayout
from ratchet.tracking import dispatch


@pytest.fixture(scope="session")
def shared_state(tmp_path_factory) -> Path:
    # One MLflow store for the tests of a session: creating its schema costs seconds, and
    # each test's run has its own run id (and its own experiment where it matters).
    return tmp_path_factory.mktemp("tracking-state")


@pytest.fixture
def state(shared_state, monkeypatch) -> Path:
    monkeypatch.setenv("RATCHET_STATE_DIR", str(shared_state))
    monkeypatch.setenv("RATCHET_TRACKING", "1")
    for var in ("MLFLOW_TRACKING_URI", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    return shared_state


@pytest.fixture
def process(monkeypatch):
    """A fresh tracking thread (what a new worker process starts with); `new()` replaces
    it, as when the worker dies and another one takes over the run."""

    class Process:
        def __init__(self) -> None:
            self.new()

        def new(self) -> dispatch.TrackingDispatcher:
            self.dispatcher = dispatch.TrackingDispatcher()
            monkeypatch.setattr(dispatch, "DISPATCHER", self.dispatcher)
            return self.dispatcher

        def flush(self) -> None:
            assert self.dispatcher.flush(120), "the tracking thread did not finish in 120 s"

    return Process()


@dataclass
class Run:
    ref: t.RunRef
    store: ObjectStore
    config: dict

    def record(self, step: int, metrics: dict) -> t.StepRecord:
        """What the record_step activity does before it calls the trackers."""
        MetricsLog(self.store).write(step, metrics)
        return t.StepRecord(self.ref, step, metrics)


def make_run(tmp_path: Path, run_id: str = "copy-20261201-000000-abcd", **tracking) -> Run:
    store = ObjectStore(str(tmp_path / "runs")).child(run_id)
    config = {
        "seed": 0,
        "trainer": {"lr": 1e-5, "betas": [0.9, 0.999]},
        "algorithm": {"adv_estimator": "grpo"},
        "tracking": {
            "name": "copy",
            "tags": ["smoke"],
            "experiment": "tracking-tests",
            "mlflow": True,
            "wandb": {"enabled": False},
            **tracking,
        },
    }
    store.put_json(RunLayout.CONFIG, config)
    return Run(t.RunRef(run_id, store.url), store, config)


def step_metrics(step: int) -> dict[str, float]:
    return {"reward_mean": 0.1 + 0.01 * step, "kl": 0.001 * step, "entropy": 2.5 - 0.01 * step, "off_policy/is_weight_mean": 1.0}
