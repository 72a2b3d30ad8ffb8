"""Stop, resume and start-up tell the truth and waste nothing.

- A run stopped between two checkpoints checkpoints the step it stopped at, so a resume
  goes on from there (each step recorded once), and `ratchet resume` says which
  checkpoint it took; while the resumed run restores, its progress shows the step and
  version being restored, never 0/0.
- A resume of a run that completed all its steps answers at once (exit 1, the command that
  trains further) and starts nothing: no workflow, no actor.
- Before the first step the progress query names the start-up phase in words.

The workflow's control flow is checked with stand-in activities on a Temporal dev server
(tests/faults/standins.py: fast, exact about which activity ran when); the whole story
once more on the real platform (Temporal, Ray, a worker; the session `platform` fixture).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from ratchet import types as t
from ratchet.platform.client import RECIPE_PATH, NothingToResume, command_for
from ratchet.platform.services import temporal_address
from ratchet.storage.checkpoint_store import CheckpointStore
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.layout import RunLayout
from ratchet.workflows.training import TrainingWorkflow

from tests.faults.standins import StandIns, dev_server, plan, run_on, start, training_input, worker_for

HISTORIES = Path(__file__).parent / "histories"
RATCHET = [sys.executable, "-m", "ratchet.platform.cli"]


def _wait(predicate, what: str, limit_s: float = 300.0, every_s: float = 0.2):
    deadline = time.monotonic() + limit_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every_s)
    return value


# -- the workflow, with stand-in activities -----------------------------------------------


@pytest.mark.slow
def test_a_stop_between_checkpoints_checkpoints_the_stop_step():
    """Checkpoints every 3 steps; the stop lands after step 4: the run checkpoints step 5
    (its stop step) after its last metrics line and before the export, once."""
    standins = StandIns(delay={"generate": 0.3})

    async def go():
        async with dev_server() as env:

            async def stop_after_step_3(handle):
                while standins.count("record_step") < 4:  # steps 0-3 written; step 4 is being made
                    await asyncio.sleep(0.02)
                await handle.signal("stop", command_for(handle.id))

            return await run_on(env.client, standins, training_input("stop5", plan(steps=8, checkpoint_every=3)), stop_after_step_3)

    summary = asyncio.run(go())
    assert summary.stopped and summary.steps == 5 and summary.policy_version == 5
    assert [c.step for c in standins.args("checkpoint")] == [3, 5]
    last = standins.args("checkpoint")[-1]
    assert last.policy_version == 5 and last.state.next_step == 5 and last.state.next_prompt == 5 * 2
    names = [n for n, _ in standins.calls]
    assert names.index("finish_run") > len(names) - 1 - names[::-1].index("checkpoint"), "checkpoint before the export"
    recorded = [r.step for r in standins.args("record_step")]
    assert recorded == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_a_stop_at_a_checkpointed_step_takes_no_second_one():
    standins = StandIns(delay={"generate": 0.3})

    async def go():
        async with dev_server() as env:

            async def stop_in_step_2(handle):
                while standins.count("record_step") < 2:
                    await asyncio.sleep(0.02)
                await handle.signal("stop", command_for(handle.id))

            return await run_on(env.client, standins, training_input("stop3", plan(steps=8, checkpoint_every=3)), stop_in_step_2)

    summary = asyncio.run(go())
    assert summary.stopped and summary.steps == 3
    assert [c.step for c in standins.args("checkpoint")] == [3]


def test_a_stop_recorded_before_checkpoint_on_stop_replays():
    """A history written by the workflow as it was before (stopped at step 5 of 8, one
    checkpoint at 3, none at the stop) replays on today's code."""
    raw = gzip.decompress((HISTORIES / "stop-before-checkpoint-on-stop.json.gz").read_bytes()).decode()
    history = WorkflowHistory.from_json("old-stop", raw)
    result = asyncio.run(Replayer(workflows=[TrainingWorkflow]).replay_workflow(history, raise_on_replay_failure=False))
    assert result.replay_failure is None, result.replay_failure


@pytest.mark.slow
def test_progress_while_restoring_shows_the_checkpoint_not_zero():
    """A resume from step-00000029 of a 31-step run: from its first query to its first
    step, the progress names the checkpoint, step 29 and version 29."""
    standins = StandIns(delay={"start_workers": 1.5})
    state = t.RunState(run=t.RunRef("r29", "/nonexistent/r29", "old"), next_step=29, next_prompt=58, next_batch=29, policy_version=29)
    inp = training_input("r29", plan(steps=31, checkpoint_every=10), resume=state, restore=True, restore_from="step-00000029")

    async def go():
        async with dev_server() as env, worker_for(env.client, standins, "restore"):
            handle = await start(env.client, inp, "restore")
            await standins.started["start_workers"].wait()
            during = await handle.query("progress", result_type=t.Progress)
            summary = await asyncio.wait_for(handle.result(), 60)
            after = await handle.query("progress", result_type=t.Progress)
            return during, summary, after

    during, summary, after = asyncio.run(go())
    assert (during.phase, during.step, during.policy_version, during.total_steps) == ("restoring from step-00000029", 29, 29, 31)
    assert during.activity == "start_workers"
    assert summary.steps == 31 and [r.step for r in standins.args("record_step")] == [29, 30]
    assert (after.phase, after.step) == ("completed", 31)


@pytest.mark.slow
def test_start_up_phases_are_named_in_the_progress():
    """Each start-up activity held a moment: the progress names warm-up, workers and the
    step-0 evaluation, in that order, then the loop's own phases."""
    standins = StandIns(delay={"prepare_run": 0.6, "warmup": 0.6, "start_workers": 0.6, "evaluate": 0.6})
    inp = training_input("phases", plan(steps=2, evaluate=True))
    inp.config = {"warmup": {"steps": 10}}

    async def go():
        async with dev_server() as env, worker_for(env.client, standins, "phases"):
            handle = await start(env.client, inp, "phases")
            seen: list[str] = []
            done = asyncio.ensure_future(handle.result())
            while not done.done():
                p = await handle.query("progress", result_type=t.Progress)
                if not seen or seen[-1] != p.phase:
                    seen.append(p.phase)
                await asyncio.sleep(0.05)
            await done
            seen.append((await handle.query("progress", result_type=t.Progress)).phase)
            return seen

    seen = asyncio.run(go())
    start_up = ["preparing the run", "warm-up (10 steps)", "starting workers", "step-0 eval"]
    assert [p for p in seen if p in start_up] == start_up, seen
    assert seen[-1] == "completed", seen


# -- the real platform --------------------------------------------------------------------

FAST = ["warmup.steps=2", "data.eval_files=null", "loop.prompts_per_step=4", "rollout.n=4", "checkpoint.every=5",
        "checkpoint.keep_last=5", "resources.trainer_cpus=0.5", "loop.steps=7"]  # fmt: skip


def _cli(platform, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RATCHET_TEMPORAL_ADDRESS": temporal_address(platform.settings), "COLUMNS": "80"}
    return subprocess.run([*RATCHET, *args], capture_output=True, text=True, timeout=300, env=env)


def _run_actors(ray, run_id: str) -> list[str]:
    """Every actor of the run Ray ever created, alive or dead (the GCS's table)."""
    from ray._private import state

    return sorted(a["ActorID"] for a in state.actors().values() if (a.get("Name") or "").startswith(f"{run_id}/"))


def test_stop_resume_and_resume_of_a_completed_run(platform, ray_driver):
    client, root = platform.client, str(platform.runs_root)
    handle = client.submit(RECIPE_PATH, platform.overrides(*FAST, "tracking.name=stopfacts"))
    run_id, run_dir = handle.run_id, platform.runs_root / handle.run_id
    # Held at a step boundary between two checkpoints (every 5), then stopped there.
    _wait(lambda: (run_dir / "metrics.jsonl").exists() and len((run_dir / "metrics.jsonl").read_text().splitlines()) >= 2, "2 steps")
    handle.pause()
    paused = _wait(lambda: (p := handle.progress()).phase == "paused" and p, "the pause")
    stop_step = paused.step
    assert 0 < stop_step < 5, f"paused at step {stop_step}: the test needs a step between checkpoints"
    handle.stop()
    stopped = handle.result(timeout=600)
    assert stopped.stopped and stopped.steps == stop_step and stopped.policy_version == stop_step
    checkpoints = CheckpointStore(ObjectStore(root).child(run_id))
    name = RunLayout.checkpoint_name(stop_step)
    assert [c.name for c in checkpoints.list()] == [name]
    assert checkpoints.get(name).meta["policy_version"] == stop_step and checkpoints.verify(name)

    # `ratchet resume` names the checkpoint it took; the restore shows it, never step 0.
    out = _cli(platform, "resume", run_id, "--root", root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"resumed run {run_id} from checkpoint {name} (step {stop_step}, policy version {stop_step})"
    seen = []
    while handle.running() and not (seen and seen[-1].step > stop_step):
        seen.append(handle.progress())
        time.sleep(0.05)
    restoring = [p for p in seen if p.phase.startswith("restoring")]
    assert restoring and all(p.phase == f"restoring from {name}" for p in restoring), [p.phase for p in seen]
    assert all(p.step >= stop_step and p.policy_version >= stop_step for p in seen), [(p.step, p.policy_version) for p in seen]
    done = handle.result(timeout=600)
    assert done.steps == 7 and done.policy_version == 7 and not done.stopped
    lines = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [json.loads(x)["step"] for x in lines] == list(range(7)), "each step's metrics exactly once"
    store = ObjectStore(done.run_uri)
    assert [store.get_json(RunLayout.train_log(v))["batch"] for v in range(7)] == list(range(7)), "each batch trained once"
    assert [c.name for c in checkpoints.list()] == [name, RunLayout.checkpoint_name(5)]

    # A completed run: refused at once, nothing started.
    actors = _run_actors(ray_driver, run_id)
    workflow_run = client._run(handle._handle().describe()).run_id
    out = _cli(platform, "resume", run_id, "--root", root)
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert out.stderr.strip() == (
        f"run {run_id} already completed all 7 steps: nothing to resume; train further with "
        f"`ratchet fork {run_id} --checkpoint {RunLayout.checkpoint_name(5)} loop.steps=14`"
    )
    assert "Traceback" not in out.stderr
    assert client._run(handle._handle().describe()).run_id == workflow_run, "no workflow was started"
    assert _run_actors(ray_driver, run_id) == actors, "no actor was created"
    # The same through the Python client; a checkpoint named at the last step says how to go on.
    with pytest.raises(NothingToResume, match="already completed all 7 steps"):
        client.resume(run_id, root=root)
    last = RunLayout.checkpoint_name(5)
    with pytest.raises(NothingToResume, match=f"is at step 5 and loop.steps is 5: nothing to resume; .*--checkpoint {last} loop.steps=10"):
        client.resume(run_id, ["loop.steps=5"], root=root, checkpoint=last)
