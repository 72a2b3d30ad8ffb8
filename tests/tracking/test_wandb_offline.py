"""wandb, offline (its default here), as the activities drive it, read back from the run
files it writes (with wandb's own protobuf records, tests/tracking/wandb_records.py):
one wandb run id per ratchet run, continued by a later process, steps logged once, the
sweep as its group, the config and the summary."""

from __future__ import annotations

import pytest
from ratchet import types as t
from ratchet.activities import tracking_calls
from ratchet.tracking import TRACKING_KEY

from tests.polling import wait_until

from .conftest import make_run, step_metrics
from .wandb_records import read_offline_run


@pytest.mark.slow
def test_offline_run_is_continued_under_one_id(state, tmp_path, process):
    run = make_run(tmp_path, "copy-20261201-000000-wdb1", mlflow=False, wandb={"enabled": True, "dir": str(tmp_path / "wb")})
    lineage = t.RunLineage(sweep_id="sweep-7", trial_index=1)
    tracking_calls.run_prepared(t.PrepareInput(run.ref.run_id, run.config, lineage), run.ref.run_uri, run.config)
    for step in range(3):
        tracking_calls.step_recorded(run.record(step, step_metrics(step)))
    process.flush()
    process.dispatcher.submit(lambda d: d.drop(run.ref.run_id))  # this process lets go of the run
    process.flush()
    # A later worker process: step 3 was written while no tracker listened, step 2 is retried.
    process.new()
    run.record(3, step_metrics(3))
    tracking_calls.step_recorded(run.record(2, step_metrics(2)))
    tracking_calls.step_recorded(run.record(4, step_metrics(4)))
    tracking_calls.run_finished(t.FinishInput(run.ref, policy_version=5))

    folders = sorted((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(folders) == 2, folders  # one per process, both under the same id: `wandb sync` joins them

    def both_written():
        # wandb's core process writes the run files behind `finish()`: on a busy machine the
        # records land a moment later (about 1 read in 10 found a file without them).
        parts = [read_offline_run(f) for f in folders]
        return parts if all(p.run_id for p in parts) and parts[1].summary.get("steps") else None

    first, second = wait_until(both_written, timeout=60)
    for part in (first, second):
        assert part.run_id == run.ref.run_id
        assert part.group == "sweep-7" and part.project == "tracking-tests"
    assert [row["_step"] for row in first.history] == [0, 1, 2]
    assert [row["_step"] for row in second.history] == [3, 4]  # 3 caught up from metrics.jsonl, 2 not again
    assert [row["reward_mean"] for row in first.history + second.history] == [0.1 + 0.01 * s for s in range(5)]
    assert first.config["trainer"]["lr"] == 1e-5 and first.config["ratchet.sweep_id"] == "sweep-7"
    assert second.summary["steps"] == 5 and second.summary["last_step"] == 4
    saved = run.store.get_json(TRACKING_KEY)
    assert saved["wandb"] == {"id": run.ref.run_id, "mode": "offline", "project": "tracking-tests", "last_step": 4}
    assert "mlflow" not in saved
