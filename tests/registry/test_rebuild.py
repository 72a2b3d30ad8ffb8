"""`rebuild_from_store`: the registry's runs and checkpoints rebuilt from run folders."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ratchet.registry.db import Registry
from ratchet.registry.records import RunRecord
from ratchet.registry.rebuild import rebuild_from_store
from ratchet.registry.rebuild import config_digest
from ratchet.storage.checkpoint_store import CheckpointStore
from ratchet.storage.layout import RunLayout

from .runfolders import write_run


@pytest.fixture
def reg(db_url):
    registry = Registry.open(db_url)
    yield registry
    registry.close()


def test_rebuild_records_runs_progress_and_checkpoints(reg, tmp_path):
    root = tmp_path / "runs"
    done = write_run(root, "done-1", rewards=[0.1, 0.2, 0.4], evals={0: 0.05, 2: 0.3}, checkpoints=(2, 3), final=True,
                     loop={"steps": 3, "mode": "one_step_off"}, tracking={"experiment": "exp-r", "name": "done"},
                     algorithm={"adv_estimator": "rloo"})  # fmt: skip
    write_run(root, "half-1", rewards=[0.5, 0.25], checkpoints=(1,), loop={"steps": 10})
    (root / "not-a-run").mkdir()
    (root / "not-a-run" / "notes.txt").write_text("x")

    report = rebuild_from_store(reg, str(root))
    assert sorted(report.runs) == ["done-1", "half-1"] and report.checkpoints == 3

    r = reg.run("done-1")
    config = done.get_json(RunLayout.CONFIG)
    assert (r.name, r.experiment, r.algorithm, r.loop_mode, r.model) == ("done", "exp-r", "rloo", "one_step_off", "/models/tiny")
    assert (r.config, r.config_digest) == (config, config_digest(config))
    assert (r.status, r.last_step, r.last_reward, r.eval_reward) == ("completed", 2, 0.4, 0.3)
    assert r.final_metrics["reward_mean"] == 0.4 and r.final_metrics["eval_reward"] == 0.3 and r.final_metrics["steps"] == 3.0
    assert [(c.name, c.step) for c in reg.checkpoints("done-1")] == [("step-00000002", 2), ("step-00000003", 3)]
    assert reg.checkpoints("done-1")[0].uri == CheckpointStore(done).get("step-00000002").uri

    h = reg.run("half-1")  # no final model, 2 of 10 steps, no row before: failed
    assert (h.status, h.last_step, h.eval_reward, h.final_metrics) == ("failed", 1, None, None)


def test_rebuild_twice_is_the_same_and_keeps_what_folders_cannot_say(reg, tmp_path):
    root = tmp_path / "runs"
    run = write_run(root, "r-1", rewards=[0.1, 0.2], checkpoints=(1, 2), loop={"steps": 2})
    write_run(root, "r-2", rewards=[0.3], loop={"steps": 5})
    # Rows the activities wrote: lineage, and a run stopped by the user.
    reg.record_run(RunRecord(run_id="r-1", parent_run_id="p", parent_checkpoint="step-00000004", sweep_id="s", trial_index=2))
    reg.record_run(RunRecord(run_id="r-2"))
    reg.finish_run("r-2", "cancelled")

    rebuild_from_store(reg, str(root))
    first = [replace(r, updated_at=None) for r in reg.runs(sort="run_id")]
    rebuild_from_store(reg, str(root))
    assert [replace(r, updated_at=None) for r in reg.runs(sort="run_id")] == first
    r1, r2 = reg.run("r-1"), reg.run("r-2")
    assert (r1.parent_run_id, r1.parent_checkpoint, r1.sweep_id, r1.trial_index, r1.status) == ("p", "step-00000004", "s", 2, "completed")
    assert r2.status == "cancelled"

    CheckpointStore(run).delete("step-00000001")  # retention removed one: the registry forgets it
    rebuild_from_store(reg, str(root))
    assert [c.name for c in reg.checkpoints("r-1")] == ["step-00000002"]


def test_a_fresh_registry_gets_the_lineage_from_the_run_folder(reg, tmp_path):
    """prepare_run writes `lineage.json` next to the config: a registry rebuilt from
    nothing still knows a fork's parent and a trial's sweep."""
    root = tmp_path / "runs"
    fork = write_run(root, "fork-1", rewards=[0.1], loop={"steps": 1})
    fork.put_json(RunLayout.LINEAGE, {"parent_run_id": "p-1", "parent_checkpoint": "step-00000004", "sweep_id": None, "trial_index": None})
    trial = write_run(root, "sw-t3", rewards=[0.2], loop={"steps": 1})
    trial.put_json(RunLayout.LINEAGE, {"parent_run_id": None, "parent_checkpoint": None, "sweep_id": "sw", "trial_index": 3})
    write_run(root, "plain", rewards=[0.3], loop={"steps": 1})

    rebuild_from_store(reg, str(root))
    f, t, p = reg.run("fork-1"), reg.run("sw-t3"), reg.run("plain")
    assert (f.parent_run_id, f.parent_checkpoint, f.sweep_id) == ("p-1", "step-00000004", None)
    assert (t.sweep_id, t.trial_index, t.parent_run_id) == ("sw", 3, None)
    assert (p.parent_run_id, p.sweep_id, p.trial_index) == (None, None, None)
