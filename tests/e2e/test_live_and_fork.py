"""Live hyper-parameters and forks through the real platform (Temporal dev server, Ray, a
`ratchet worker`), with the tiny model.

- A run's lr is changed mid-run (`RunHandle.set`), its trainer actor is killed, and the
  trainer is rebuilt from the last checkpoint plus the logged updates: the replay repeats
  each update with the lr it used (the rebuilt weights equal the lost ones bit for bit),
  and the updates after it use the new lr (the metrics' `lr` per step, the train log, the
  next checkpoint's run state and optimizer state).
- A fork of that run from one of its checkpoints, with an override, is a new run that
  starts at the checkpoint's step, is linked to its parent, and leaves the parent's folder
  as it was.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from ratchet.platform.client import RECIPE_PATH, LiveChangeRefused
from ratchet.storage.checkpoint_store import CheckpointStore
from ratchet.storage.object_store import ObjectStore

pytestmark = pytest.mark.integration

OLD_LR, NEW_LR, FORK_LR = 1e-3, 2e-4, 5e-5  # the recipe's lr, the live one, the fork's
STEPS = 6
FAST = [
    "warmup.steps=2", "data.eval_files=null", "loop.prompts_per_step=4", "rollout.n=4", "resources.trainer_cpus=0.5",
    "checkpoint.every=3", "checkpoint.keep_last=5", "deterministic=true", f"trainer.lr={OLD_LR}",
]  # fmt: skip


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def wait_for(predicate, what: str, limit_s: float = 300.0):
    """Poll until `predicate()` is truthy (a hang fails the test; no speed is asserted)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def progress(handle):
    from temporalio.service import RPCError

    try:
        return handle.progress()
    except RPCError:  # no workflow task has run yet
        return None


def pause_at_step(handle, at_least: int) -> int:
    """Pause the run at its first step boundary at or after `at_least`; the step it holds at."""
    wait_for(lambda: (p := progress(handle)) is not None and p.step >= at_least, f"step {at_least}")
    handle.pause()
    return wait_for(lambda: (p := progress(handle)) is not None and p.phase == "paused" and p.step, "the pause")


def export_weights(ray, actors, key: str) -> dict:
    ray.get([a.export.remote(key) for a in actors.trainer.ranks()])
    return load_file(str(Path(actors.run_uri) / key / "model.safetensors"))


def folder_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def live_run(platform, ray_driver):
    """The run whose lr changes mid-run and whose trainer is killed; facts about it."""
    from ratchet.config import RunConfig
    from ratchet.workers.actors import RunActors

    client = platform.client
    handle = client.submit(RECIPE_PATH, platform.overrides(*FAST, f"loop.steps={STEPS}", "tracking.name=live"))
    changed_at = pause_at_step(handle, 1)
    with pytest.raises(LiveChangeRefused, match=r"trainer.lr: must be > 0.0, got -1.0"):
        handle.set(**{"trainer.lr": -1.0})
    change = handle.set([f"trainer.lr={NEW_LR}"])
    handle.resume()

    # Paused again after at least one update with the new lr; the trainer is then lost.
    killed_at = pause_at_step(handle, changed_at + 1)
    run_uri = str(platform.runs_root / handle.run_id)
    cfg = RunConfig.model_validate(ObjectStore(run_uri).get_json("config.json"))
    actors = RunActors(handle.run_id, run_uri, cfg)
    before = export_weights(ray_driver, actors, "test/before-kill")
    lost = actors.trainer.ranks()[0]
    ray_driver.kill(lost, no_restart=True)
    # Rebuilt as the next step's activity would rebuild it: the last checkpoint at or
    # before v`killed_at` plus a replay of the logged updates after it.
    rebuilt = actors.trainer.at_version(killed_at)
    assert rebuilt[0]._actor_id != lost._actor_id
    after = export_weights(ray_driver, actors, "test/rebuilt")
    handle.resume()
    summary = handle.result(timeout=600)
    return {"summary": summary, "change": change, "changed_at": changed_at, "killed_at": killed_at, "before": before, "after": after}


def test_live_lr_is_used_from_its_step_and_survives_a_lost_trainer(live_run):
    summary, change = live_run["summary"], live_run["change"]
    changed_at, killed_at = live_run["changed_at"], live_run["killed_at"]
    assert summary.steps == STEPS and changed_at < killed_at < STEPS
    assert (change.from_step, change.values, change.previous) == (changed_at, {"trainer.lr": NEW_LR}, {"trainer.lr": OLD_LR})

    # The replay repeated every update with the lr it used: the rebuilt trainer holds the
    # lost one's weights bit for bit (a replay at the new lr would not).
    before, after = live_run["before"], live_run["after"]
    assert before.keys() == after.keys() and all((before[k] == after[k]).all() for k in before)

    run_dir = Path(summary.run_uri)
    lines = metrics(run_dir)
    assert [m["step"] for m in lines] == list(range(STEPS))
    assert [m["lr"] for m in lines] == [OLD_LR] * changed_at + [NEW_LR] * (STEPS - changed_at)
    assert [m["step"] for m in lines if m.get("live_changed")] == [changed_at]
    store = ObjectStore(summary.run_uri)
    logged = [store.get_json(f"train_log/v{v:08d}.json") for v in range(STEPS)]
    assert [e["optimizer"]["lr"] for e in logged] == [OLD_LR] * changed_at + [NEW_LR] * (STEPS - changed_at)
    assert [e["live"] for e in logged] == [{}] * changed_at + [{"trainer.lr": NEW_LR}] * (STEPS - changed_at)

    # The last checkpoint (taken after the rebuild) holds the change: run state and optimizer.
    ckpt = run_dir / "checkpoints" / f"step-{STEPS:08d}"
    state = json.loads((ckpt / "run_state.json").read_text())
    assert state["live"] == {"values": {"trainer.lr": NEW_LR}, "changes": 1, "last_step": changed_at}
    groups = json.loads((ckpt / "trainer" / "trainer_meta.json").read_text())["param_groups"]
    assert [g["lr"] for g in groups] == [NEW_LR] * len(groups)


def test_fork_starts_a_linked_run_at_the_parents_checkpoint(platform, live_run):
    parent = live_run["summary"]
    parent_dir = Path(parent.run_uri)
    checkpoints = CheckpointStore(ObjectStore(parent.run_uri))
    first = checkpoints.list()[0]  # step 3 (checkpoint.every=3), unless the kill lost its upload
    end = first.step + 1
    digest = folder_digest(parent_dir)

    root = str(platform.runs_root)
    with pytest.raises(Exception, match="rollout.n: a resume cannot change it"):
        platform.client.fork(parent.run_id, f"step-{first.step}", ["rollout.n=2"], root=root)
    with pytest.raises(FileNotFoundError, match=f"has no checkpoint 'step-99'; it has: {first.name}"):
        platform.client.fork(parent.run_id, "step-99", root=root)
    with pytest.raises(ValueError, match=f"at step {first.step} and the fork would end at loop.steps={first.step}"):
        platform.client.fork(parent.run_id, first.name, [f"loop.steps={first.step}"], root=root)
    child = platform.client.fork(
        parent.run_id, f"step-{first.step}", [f"trainer.lr={FORK_LR}", f"loop.steps={end}"], root=str(platform.runs_root)
    )
    assert child.run_id != parent.run_id
    summary = child.result(timeout=600)
    assert summary.steps == end and summary.policy_version == end

    child_dir = Path(summary.run_uri)
    lines = metrics(child_dir)
    assert [m["step"] for m in lines] == list(range(first.step, end)), "the child starts at the parent's checkpoint"
    # The override wins over the lr the parent set live (the parent's step-3 state has it
    # when the change came before step 3).
    assert [m["lr"] for m in lines] == [FORK_LR] * len(lines)
    assert json.loads((child_dir / "config.json").read_text())["trainer"]["lr"] == FORK_LR
    assert folder_digest(parent_dir) == digest, "the parent's folder is left as it was"

    started = child.history().events[0].workflow_execution_started_event_attributes
    # The payload is sealed (payload_codec): opened with the client's converter.
    [inp] = platform.client._run(platform.client._temporal.data_converter.decode(started.input.payloads))
    assert inp["lineage"]["parent_run_id"] == parent.run_id and inp["lineage"]["parent_checkpoint"] == first.name
    assert inp["resume"]["next_step"] == first.step
