"""The training activities write the registry: prepare_run and record_step called as the
worker calls them (on a tiny run folder; they need no Ray), the checkpoint, finish and
release hooks through `registry_calls`; a registry that fails never fails an activity."""

from __future__ import annotations

import logging

import pytest

from ratchet import types as t
from ratchet.activities import registry_calls
from ratchet.activities.training import config_digest, prepare_run, record_step
from ratchet.platform.services import free_ports
from ratchet.registry.db import Registry
from ratchet.storage.metrics_log import MetricsLog
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.layout import RunLayout

from .conftest import PG_PASSWORD
from .runfolders import stored_config, write_run


@pytest.fixture(autouse=True)
def _no_backoff():
    """Each test starts with a registry not backed off by an earlier test's failure."""
    registry_calls._retry_after = 0.0
    yield
    registry_calls._retry_after = 0.0


@pytest.fixture
def reg(db_url, monkeypatch):
    monkeypatch.setenv("RATCHET_REGISTRY_URL", db_url)
    registry = Registry.open(db_url)
    yield registry
    registry.close()


def test_a_run_lands_in_the_registry(reg, tmp_path):
    root = tmp_path / "runs"
    config = stored_config(root, loop={"steps": 3}, tracking={"experiment": "exp-act", "name": "act"})
    lineage = t.RunLineage(parent_run_id="parent-1", parent_checkpoint="step-00000002", sweep_id="sw", trial_index=1)
    inp = t.PrepareInput("act-1", config, lineage)
    prep = prepare_run(inp)
    assert prepare_run(inp) == prep  # a retried prepare_run: the same row
    r = reg.run("act-1")
    assert (r.status, r.experiment, r.name, r.algorithm, r.loop_mode) == ("running", "exp-act", "act", "grpo", "sync")
    assert r.config_digest == prep.run.config_id == config_digest(r.config)
    assert (r.parent_run_id, r.parent_checkpoint, r.sweep_id, r.trial_index) == ("parent-1", "step-00000002", "sw", 1)

    for step, (reward, ev) in enumerate([(0.1, None), (0.3, 0.25), (0.2, None)]):
        metrics = {"reward_mean": reward, **({"eval_reward": ev} if ev is not None else {})}
        record_step(t.StepRecord(prep.run, step, metrics))
        record_step(t.StepRecord(prep.run, step, metrics))  # retried local activity
        registry_calls.flush()  # progress rows are written in the background, in order
        r = reg.run("act-1")
        assert (r.last_step, r.last_reward) == (step, reward)
    assert r.eval_reward == 0.25 and len(MetricsLog(ObjectStore(prep.run.run_uri)).read()) == 3

    run_store = write_run(root, "act-1", rewards=[0.1, 0.3, 0.2], evals={1: 0.25}, checkpoints=(2,), loop={"steps": 3})
    registry_calls.checkpoints_changed(prep.run)
    registry_calls.run_finished(prep.run, total_steps=3)
    registry_calls.run_finished(prep.run, total_steps=3)  # a retried finish_run
    r = reg.run("act-1")
    assert r.status == "completed" and r.final_metrics["reward_mean"] == 0.2 and r.final_metrics["steps"] == 3.0
    assert [(c.name, c.step) for c in reg.checkpoints("act-1")] == [("step-00000002", 2)]
    assert reg.checkpoints("act-1")[0].uri == run_store.uri(RunLayout.checkpoint("step-00000002"))
    registry_calls.run_released(t.ReleaseInput("act-1"))  # after completion: left as it is
    assert reg.run("act-1").status == "completed"
    assert len(reg.runs()) == 1


def test_stopped_and_failed_runs(reg, tmp_path):
    root = tmp_path / "runs"
    for run_id in ("stop-1", "fail-1"):
        prepare_run(t.PrepareInput(run_id, stored_config(root, loop={"steps": 10})))
    write_run(root, "stop-1", rewards=[0.1, 0.2], loop={"steps": 10})
    registry_calls.run_finished(t.RunRef("stop-1", str(root / "stop-1")), total_steps=10)
    registry_calls.run_released(t.ReleaseInput("fail-1"))
    assert (reg.run("stop-1").status, reg.run("fail-1").status) == ("stopped", "failed")


def test_a_registry_that_fails_never_fails_the_activity(tmp_path, monkeypatch, caplog):
    """A database that is down: the activity completes and writes its files; the warning
    names the registry with its password masked and says how to rebuild."""
    (port,) = free_ports(1)
    monkeypatch.setenv("RATCHET_REGISTRY_URL", f"postgresql+psycopg://ratchet:{PG_PASSWORD}@127.0.0.1:{port}/none")
    caplog.set_level(logging.DEBUG)
    prep = prepare_run(t.PrepareInput("down-1", stored_config(tmp_path / "runs")))
    record_step(t.StepRecord(prep.run, 0, {"reward_mean": 0.5}))  # within RETRY_AFTER_S: not tried
    registry_calls.flush()
    assert ObjectStore(prep.run.run_uri).exists(RunLayout.CONFIG) and ObjectStore(prep.run.run_uri).exists(RunLayout.METRICS)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "run registry" in r.getMessage()]
    assert len(warnings) == 1 and "ratchet registry rebuild" in warnings[0] and "ratchet:***@127.0.0.1" in warnings[0]
    assert "step_recorded skipped" in caplog.text
    assert PG_PASSWORD not in caplog.text


def test_registry_off_writes_nothing(tmp_path, monkeypatch):
    db = tmp_path / "state" / "registry.db"
    monkeypatch.setenv("RATCHET_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("RATCHET_REGISTRY_URL", "off")
    prepare_run(t.PrepareInput("off-1", stored_config(tmp_path / "runs")))
    assert not db.exists()
    monkeypatch.delenv("RATCHET_REGISTRY_URL")  # the default: SQLite in the state folder
    prepare_run(t.PrepareInput("on-1", stored_config(tmp_path / "runs")))
    assert db.exists() and [r.run_id for r in Registry.open(f"sqlite:///{db}").runs()] == ["on-1"]
