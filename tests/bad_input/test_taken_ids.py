"""A new run or sweep under an id that another one has is refused before anything is written.

Before: `Client.submit(config, run_id=X)` for a run X that had ended started a second
workflow X (Temporal lets a closed workflow's id start again), whose `prepare_run`
overwrote X's config.json, and its steps X's checkpoints and metrics; fork refused only an
existing folder, and a sweep id was not checked at all. Now submit, fork and sweep refuse
an id that Temporal knows (any state), that has a folder under storage.root, or that the
run registry lists (src/ratchet/platform/taken_ids.py).

Real parts: a Temporal dev server, a local object store, a SQLite registry; no worker runs
(nothing here needs a run to make progress).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from ratchet.platform.client import RECIPE_PATH, Client
from ratchet.platform.taken_ids import IdTaken
from ratchet.sweep_types import SweepInput, SweepPlan
from ratchet.types import LoopPlan, TrainingInput

from ..faults.standins import dev_server


@pytest.fixture(scope="module")
def client():
    """A ratchet Client on a Temporal dev server of its own (no worker: nothing runs); each
    test uses ids of its own."""
    loop = asyncio.new_event_loop()
    env_cm = dev_server()
    env = loop.run_until_complete(env_cm.__aenter__())
    try:
        yield Client(env.client, loop, "no-worker")
    finally:
        loop.run_until_complete(env_cm.__aexit__(None, None, None))
        loop.close()


@pytest.fixture
def no_registry(monkeypatch):
    monkeypatch.setenv("RATCHET_REGISTRY_URL", "off")


def overrides(assets, root) -> list[str]:
    train, evals = assets.data["copy"]
    return [f"model.path={assets.model}", f"data.train_files={train}", f"data.eval_files={evals}", f"storage.root={root}"]


def workflow_status(client: Client, workflow_id: str):
    try:
        return client._run(client._temporal.get_workflow_handle(workflow_id).describe()).status
    except RPCError as exc:
        assert exc.status == RPCStatusCode.NOT_FOUND, exc
        return None


def test_submit_refuses_the_id_of_a_run_temporal_knows(client, assets, tmp_path, no_registry):
    """A run that ended (here: terminated) left no folder under this root: its id is still taken."""
    old = TrainingInput(run_id="taken-1", config={}, plan=LoopPlan(steps=1, prompts_per_step=1, eval_every=0))
    handle = client._run(client._temporal.start_workflow("TrainingWorkflow", old, id="taken-1", task_queue="no-worker"))
    client._run(handle.terminate("the old run ended"))

    with pytest.raises(IdTaken) as excinfo:
        client.submit(RECIPE_PATH, overrides(assets, tmp_path), run_id="taken-1")

    message = str(excinfo.value)
    assert "run id 'taken-1' is taken (Temporal has a terminated workflow with that id)" in message, message
    assert "`ratchet resume taken-1`" in message and "`ratchet fork taken-1 --checkpoint step-N`" in message
    assert "pick another id" in message
    history = client._run(client._temporal.get_workflow_handle("taken-1").fetch_history())
    assert history.run_id == handle.result_run_id  # no second workflow was started
    assert not (tmp_path / "taken-1").exists()


def test_submit_refuses_the_id_of_a_run_folder_and_writes_nothing(client, assets, tmp_path, no_registry):
    """A run whose workflow Temporal no longer keeps (retention) still has its folder."""
    folder = tmp_path / "taken-2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"the": "old run's"}))
    (folder / "metrics.jsonl").write_text('{"step": 0}\n')

    with pytest.raises(IdTaken, match=rf"run id 'taken-2' is taken \(it has a folder under {tmp_path}\)"):
        client.submit(RECIPE_PATH, overrides(assets, tmp_path), run_id="taken-2")

    assert json.loads((folder / "config.json").read_text()) == {"the": "old run's"}
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "metrics.jsonl"]
    assert workflow_status(client, "taken-2") is None


def test_submit_refuses_an_id_the_registry_lists(client, assets, tmp_path, monkeypatch):
    from ratchet.registry.db import Registry
    from ratchet.registry.records import RunRecord

    url = f"sqlite:///{tmp_path / 'registry.db'}"
    monkeypatch.setenv("RATCHET_REGISTRY_URL", url)
    with Registry.open(url) as reg:
        reg.record_run(RunRecord(run_id="taken-3", status="completed"))  # its folder is under another root

    with pytest.raises(IdTaken, match=r"run id 'taken-3' is taken \(the run registry lists it\)"):
        client.submit(RECIPE_PATH, overrides(assets, tmp_path / "runs"), run_id="taken-3")
    assert workflow_status(client, "taken-3") is None


def test_a_fresh_id_still_starts(client, assets, tmp_path, no_registry):
    handle = client.submit(RECIPE_PATH, overrides(assets, tmp_path), run_id="fresh-1")
    assert workflow_status(client, handle.run_id) == WorkflowExecutionStatus.RUNNING  # queued: no worker here


def test_a_sweep_refuses_an_id_temporal_knows(client, tmp_path, no_registry):
    from ratchet.platform.sweeps import start_sweep

    plan = SweepPlan(trials=1, parallelism=1)
    base = {"storage": {"root": str(tmp_path)}}
    spec = {"name": "s", "search": "grid", "objective": {"metric": "reward_mean"}}
    handle = client._run(client._temporal.start_workflow("SweepWorkflow", SweepInput("sweep-1", spec, base, plan), id="sweep-1",
                                                         task_queue="no-worker"))  # fmt: skip
    client._run(handle.terminate("the old sweep ended"))

    with pytest.raises(IdTaken, match=r"sweep id 'sweep-1' is taken \(Temporal has a terminated workflow"):
        start_sweep(client, SweepInput("sweep-1", spec, base, plan))
    (tmp_path / "sweep-2-t0").mkdir()
    (tmp_path / "sweep-2-t0" / "config.json").write_text("{}")
    with pytest.raises(IdTaken, match=r"sweep id 'sweep-2' is taken \(its trial sweep-2-t0 has a folder"):
        start_sweep(client, SweepInput("sweep-2", spec, base, plan))
    assert workflow_status(client, "sweep-2") is None


def test_fork_refuses_a_new_id_temporal_knows(client, assets, tmp_path, no_registry):
    """Fork used to look only for the new id's folder: a run that Temporal still knew was
    restarted under it, its folder rewritten."""
    from ratchet.config import load_config
    from ratchet.storage.checkpoint_store import CheckpointStore
    from ratchet.storage.object_store import ObjectStore
    from ratchet.storage.layout import RunLayout

    parent = ObjectStore(str(tmp_path)).child("parent-1")
    parent.put_json(RunLayout.CONFIG, load_config(RECIPE_PATH, overrides(assets, tmp_path)).model_dump(mode="json"))
    local = tmp_path.parent / f"{tmp_path.name}-ckpt"
    local.mkdir()
    (local / RunLayout.RUN_STATE).write_text(json.dumps({"run": {"run_id": "parent-1", "run_uri": parent.root}, "next_step": 2}))
    CheckpointStore(parent).commit("step-00000002", local, {"step": 2})
    old = TrainingInput(run_id="taken-4", config={}, plan=LoopPlan(steps=1, prompts_per_step=1, eval_every=0))
    handle = client._run(client._temporal.start_workflow("TrainingWorkflow", old, id="taken-4", task_queue="no-worker"))
    client._run(handle.terminate("the old run ended"))

    with pytest.raises(IdTaken, match=r"run id 'taken-4' is taken \(Temporal has a terminated workflow with that id\)"):
        client.fork("parent-1", "step-2", root=str(tmp_path), new_run_id="taken-4")
    assert not (tmp_path / "taken-4").exists()  # nothing copied
    history = client._run(client._temporal.get_workflow_handle("taken-4").fetch_history())
    assert history.run_id == handle.result_run_id
