"""The registry's reads and writes on SQLite and a real PostgreSQL server: every write an
idempotent upsert (a retried activity writes nothing twice), filters, sorting, and the
fields a later partial write keeps."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
from sqlalchemy import func, select

from ratchet.registry.db import Registry
from ratchet.registry.records import RunRecord, SweepRecord, TrialRecord
from ratchet.registry.tables import Checkpoint, Run, Sweep, Trial


@pytest.fixture
def reg(db_url):
    registry = Registry.open(db_url)
    yield registry
    registry.close()


def counts(reg: Registry) -> dict[str, int]:
    with reg.engine.connect() as conn:
        return {m.__tablename__: conn.execute(select(func.count()).select_from(m)).scalar_one() for m in (Run, Checkpoint, Sweep, Trial)}


def without_times(record):
    if record is None:
        return None
    return replace(record, **{k: None for k in ("created_at", "updated_at") if hasattr(record, k)})


RUN = RunRecord(
    run_id="r1", name="copy", experiment="exp-a", algorithm="grpo", loop_mode="sync", model="/m/tiny",
    config_digest="abc123", config={"trainer": {"lr": 0.001}, "tracking": {"experiment": "exp-a"}},
    parent_run_id="r0", parent_checkpoint="step-00000002", sweep_id="s1", trial_index=3,
)  # fmt: skip


def test_a_run_goes_through_its_life(reg):
    reg.record_run(RUN)
    reg.record_progress("r1", 0, 0.25)
    reg.record_progress("r1", 1, 0.5, eval_reward=0.4)
    reg.record_progress("r1", 2, 0.75)  # no eval on this step: the last eval reward stays
    reg.record_checkpoint("r1", 2, "step-00000002", "/runs/r1/checkpoints/step-00000002")
    reg.finish_run("r1", "completed", {"reward_mean": 0.75, "steps": 3})
    got = reg.run("r1")
    assert without_times(got) == replace(
        RUN, status="completed", last_step=2, last_reward=0.75, eval_reward=0.4, final_metrics={"reward_mean": 0.75, "steps": 3.0}
    )
    assert got.created_at.tzinfo is not None and got.updated_at >= got.created_at
    assert [(c.name, c.step, c.uri) for c in reg.checkpoints("r1")] == [("step-00000002", 2, "/runs/r1/checkpoints/step-00000002")]
    assert reg.run("nope") is None


def test_retried_writes_write_nothing_twice(reg):
    """Each write done twice (a retried activity) leaves the same rows and values as once."""
    writes = [
        lambda: reg.record_run(RUN),
        lambda: reg.record_progress("r1", 4, 0.5, 0.25),
        lambda: reg.record_checkpoint("r1", 4, "step-00000004", "u4"),
        lambda: reg.finish_run("r1", "completed", {"reward_mean": 0.5}),
        lambda: reg.record_sweep(SweepRecord(sweep_id="s1", name="sw", spec={"trials": 6}, objective="eval_reward")),
        lambda: reg.record_trial(TrialRecord(sweep_id="s1", trial_index=3, run_id="r1", params={"lr": 0.001}, state="running")),
        lambda: reg.set_sweep_status("s1", "completed", best_trial_index=3),
    ]
    for write in writes:
        write()
        before = (counts(reg), without_times(reg.run("r1")), reg.checkpoints("r1"), without_times(reg.sweep("s1")),
                  [without_times(t) for t in reg.trials("s1")])  # fmt: skip
        write()
        after = (counts(reg), without_times(reg.run("r1")), reg.checkpoints("r1"), without_times(reg.sweep("s1")),
                 [without_times(t) for t in reg.trials("s1")])  # fmt: skip
        assert after == before
    assert counts(reg) == {"runs": 1, "checkpoints": 1, "sweeps": 1, "trials": 1}


def test_a_resume_keeps_progress_creation_time_and_lineage(reg):
    reg.record_run(RUN)
    created = reg.run("r1").created_at
    reg.record_progress("r1", 5, 0.5, 0.3)
    reg.finish_run("r1", "failed")
    # The resumed run's prepare_run: another config, no lineage in the record.
    reg.record_run(replace(RUN, config={"trainer": {"lr": 0.002}}, config_digest="def", parent_run_id=None,
                           parent_checkpoint=None, sweep_id=None, trial_index=None))  # fmt: skip
    got = reg.run("r1")
    assert (got.status, got.last_step, got.eval_reward, got.created_at) == ("running", 5, 0.3, created)
    assert (got.config, got.config_digest) == ({"trainer": {"lr": 0.002}}, "def")
    assert (got.parent_run_id, got.parent_checkpoint, got.sweep_id, got.trial_index) == ("r0", "step-00000002", "s1", 3)


def test_progress_of_an_unknown_run_makes_its_row(reg):
    """A run whose prepare_run write was lost still shows up (the rest fills in later)."""
    reg.record_progress("late", 7, 0.125)
    reg.record_checkpoint("late2", 3, "step-00000003", "u")
    assert (reg.run("late").status, reg.run("late").last_step, reg.run("late").last_reward) == ("running", 7, 0.125)
    assert [c.name for c in reg.checkpoints("late2")] == ["step-00000003"]
    reg.record_run(replace(RUN, run_id="late"))
    assert reg.run("late").experiment == "exp-a" and reg.run("late").last_step == 7


def test_filters_sort_and_limit(reg):
    for i, (exp, reward, status) in enumerate(
        [("a", 0.2, "completed"), ("b", 0.9, "failed"), ("a", 0.5, "running"), ("a", None, "running")]
    ):
        reg.record_run(RunRecord(run_id=f"run-{i}", experiment=exp))
        if reward is not None:
            reg.record_progress(f"run-{i}", i, reward)
        if status != "running":
            reg.finish_run(f"run-{i}", status)
    ids = lambda rs: [r.run_id for r in rs]  # noqa: E731
    assert ids(reg.runs(sort="reward")) == ["run-1", "run-2", "run-0", "run-3"]  # no reward: last
    assert ids(reg.runs(sort="reward", descending=False)) == ["run-0", "run-2", "run-1", "run-3"]
    assert ids(reg.runs(experiment="a", sort="run_id", descending=False)) == ["run-0", "run-2", "run-3"]
    assert ids(reg.runs(status="running", sort="run_id")) == ["run-3", "run-2"]
    assert ids(reg.runs(sort="step", limit=2)) == ["run-2", "run-1"]
    assert ids(reg.runs(run_ids=["run-1", "run-3", "absent"], sort="run_id", descending=False)) == ["run-1", "run-3"]
    with pytest.raises(ValueError, match="sort must be one of created, updated"):
        reg.runs(sort="loss")
    with pytest.raises(ValueError, match="status must be one of running"):
        reg.runs(status="done")


def test_trials_keep_what_a_later_partial_write_lacks(reg):
    reg.record_sweep(SweepRecord(sweep_id="s", name="copy-sweep", spec={"space": {"lr": [1, 2]}}, objective="eval_reward"))
    reg.record_trial(TrialRecord(sweep_id="s", trial_index=1, params={"trainer.lr": 1e-3}))
    reg.record_trial(TrialRecord(sweep_id="s", trial_index=0, params={"trainer.lr": 1e-4}))
    reg.record_trial(TrialRecord(sweep_id="s", trial_index=1, run_id="run-x", state="running", last_reported_step=4))
    reg.record_trial(TrialRecord(sweep_id="s", trial_index=1, state="pruned", objective_value=0.125))
    t0, t1 = reg.trials("s")
    assert (t0.trial_index, t0.state, t0.run_id, t0.params) == (0, "pending", None, {"trainer.lr": 1e-4})
    assert (t1.trial_index, t1.state, t1.run_id, t1.params, t1.objective_value, t1.last_reported_step) == (
        1, "pruned", "run-x", {"trainer.lr": 1e-3}, 0.125, 4,
    )  # fmt: skip
    reg.set_sweep_status("s", "running", best_trial_index=0)
    reg.record_sweep(SweepRecord(sweep_id="s", status="completed", objective="eval_reward"))  # status only
    s = reg.sweep("s")
    assert (s.status, s.best_trial_index, s.spec, s.name) == ("completed", 0, {"space": {"lr": [1, 2]}}, "")
    assert [x.sweep_id for x in reg.sweeps()] == ["s"]
    with pytest.raises(KeyError, match="record_sweep it first"):
        reg.set_sweep_status("missing", "completed")
    with pytest.raises(ValueError, match="trial state must be one of pending, running, completed, pruned, failed"):
        reg.record_trial(TrialRecord(sweep_id="s", trial_index=2, state="stopped"))
    with pytest.raises(ValueError, match="run status must be one of"):
        reg.finish_run("r", "done")


def test_postgres_password_never_logged(postgres, caplog):
    """The URL's password appears in no log line, repr or error of the registry."""
    from ratchet.registry.urls import safe_url

    from .conftest import PG_PASSWORD

    url = postgres.create_database("pwcheck")
    caplog.set_level(logging.DEBUG)
    reg = Registry.open(url)
    reg.record_run(RunRecord(run_id="r"))
    assert PG_PASSWORD not in repr(reg) and PG_PASSWORD not in reg.url and "***" in reg.url
    assert safe_url(url) == url.replace(PG_PASSWORD, "***")
    assert PG_PASSWORD not in caplog.text
    reg.close()
