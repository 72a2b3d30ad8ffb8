"""Commands that reach a training run during the step after which it continues as new.

The workflow's pause, stop and drain flags live in the workflow object, which a
continue-as-new leaves behind: the next run starts with fresh ones. A stop received in that
step used to be dropped (the run trained on to loop.steps, and a sweep's prune of a trial was
lost), and so were a pause and a drain. Now a stop ends the run there, a pause or a drain
travels to the next run (TrainingInput.carried), and a live change travels in the run state.

Each test holds the step's `train` call (the stand-in waits on a gate), sends the command,
then lets the step finish: the command is in the history before the step ends, whatever
the machine's speed. The workflow is the real one on a Temporal dev server; the activities
are stand-ins (tests/faults/standins.py).
"""

from __future__ import annotations

import asyncio
import gzip
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle, WorkflowHistory, WorkflowUpdateFailedError
from temporalio.worker import Replayer

from ratchet.platform.client import command_for
from ratchet.types import LiveChange, Progress, RunSummary
from ratchet.workflows.training import TrainingWorkflow

from .standins import StandIns, dev_server, plan, run_on, training_input

# 4 steps, continuing as new after step 2; the commands come during step index 1 (trained
# from version 1), the step after which the run continues as new.
STEPS, EVERY, HELD_VERSION = 4, 2, 1
# A config the live check validates against (no file is read).
CONFIG = {"model": {"path": "/nowhere"}, "data": {"train_files": "/nowhere.parquet"}}


class Gate:
    """Holds the `train` call from policy version `version` until the test lets it go."""

    def __init__(self, version: int = HELD_VERSION):
        self.version = version
        self.reached = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, inp) -> None:
        if inp.policy_version == self.version:
            self.reached.set()
            await self.release.wait()


@pytest.fixture(scope="module")
def server():
    """One dev server for the module (its own event loop); each test connects a client."""
    loop = asyncio.new_event_loop()
    server_cm = dev_server()
    env = loop.run_until_complete(server_cm.__aenter__())
    try:
        yield env.client.service_client.config.target_host
    finally:
        loop.run_until_complete(server_cm.__aexit__(None, None, None))
        loop.close()


def run_with(server: str, standins: StandIns, run_id: str, during, *, mode: str = "sync", **fields) -> RunSummary:
    async def go():
        client = await Client.connect(server)
        loop_plan = plan(steps=STEPS, continue_as_new_every=EVERY, mode=mode)
        return await run_on(client, standins, training_input(run_id, loop_plan, **fields), during)

    return asyncio.run(go())


async def held_then(gate: Gate, send) -> None:
    """Wait until the step is held, send the command, let the step finish."""
    await asyncio.wait_for(gate.reached.wait(), 60)
    await send()
    gate.release.set()


async def paused_progress(handle: WorkflowHandle) -> Progress:
    """The progress once the run waits at a boundary, paused; fails as soon as the run has
    ended without pausing (the polls only wait, they time nothing)."""
    for _ in range(1200):
        progress = await handle.query("progress", result_type=Progress)
        if progress.phase == "paused":
            return progress
        if (await handle.describe()).status != WorkflowExecutionStatus.RUNNING:
            raise AssertionError(f"the run ended without pausing: {progress}")
        await asyncio.sleep(0.05)
    raise AssertionError(f"never paused: {progress}")


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "fully_async"])
def test_a_stop_in_the_step_that_continues_as_new_ends_the_run_there(server, mode):
    """Before: the stop was dropped with the workflow object and the run trained all 4 steps
    (a sweep's prune of a trial was lost the same way)."""
    gate = Gate()
    standins = StandIns(before={"train": gate})

    async def stop(handle):
        await held_then(gate, lambda: handle.signal("stop", command_for(handle.id)))

    summary = run_with(server, standins, f"stop-{mode}", stop, mode=mode)

    assert summary.stopped and summary.steps == 2, summary
    assert [i.policy_version for i in standins.args("train")] == [0, 1]
    assert standins.count("finish_run") == 1 and standins.count("release_run") == 0


def test_a_pause_in_the_step_that_continues_as_new_holds_the_next_run(server):
    """Before: the pause was dropped and the run trained on to its end."""
    gate = Gate()
    standins = StandIns(before={"train": gate})
    seen = {}

    async def pause_then_resume(handle):
        await held_then(gate, lambda: handle.signal("pause", command_for(handle.id)))
        progress = await paused_progress(handle)
        seen["progress"], seen["steps"] = progress, standins.count("step")
        seen["continued"] = (await handle.describe()).run_id != handle.first_execution_run_id
        await handle.signal("resume", command_for(handle.id))

    summary = run_with(server, standins, "pause", pause_then_resume)

    progress = seen["progress"]
    assert progress.paused and progress.step == 2 and seen["steps"] == 2, seen
    assert seen["continued"]  # held by the run after the continue-as-new
    assert summary.steps == STEPS and not summary.stopped


def test_a_drain_in_the_step_that_continues_as_new_moves_off_the_node_first(server):
    """Before: the drain was dropped; the run never moved off the node and lost it
    unplanned. Now the next run checkpoints and moves off before its first step."""
    gate = Gate()
    standins = StandIns(before={"train": gate})

    async def drain(handle):
        await held_then(gate, lambda: handle.signal("drain", "node-a"))

    summary = run_with(server, standins, "drain", drain)

    assert summary.steps == STEPS
    assert [i.node_ids for i in standins.args("evacuate_nodes")] == [["node-a"]]
    assert [i.step for i in standins.args("checkpoint")] == [2]  # what the rebuilt actors restore
    started = [(name, inp) for kind, name, inp in standins.log if kind == "start" and name in ("step", "evacuate_nodes")]
    assert [name for name, _ in started][:3] == ["step", "step", "evacuate_nodes"], started


def test_a_live_change_in_the_step_that_continues_as_new_applies_in_the_next_run(server):
    """A `set_params` accepted during the step applies from the next step, in the next run;
    one past its field's bound (`trainer.ppo_epochs=10**9`) is refused by the run itself."""
    gate = Gate()
    standins = StandIns(before={"train": gate})
    answers, refusals = [], []

    async def set_lr(handle):
        async def send():
            try:
                await handle.execute_update("set_params", {"trainer.ppo_epochs": 10**9}, result_type=LiveChange)
            except WorkflowUpdateFailedError as exc:
                refusals.append(exc.cause.message)
            answers.append(await handle.execute_update("set_params", {"trainer.lr": 5e-5}, result_type=LiveChange))

        await held_then(gate, send)

    summary = run_with(server, standins, "live", set_lr, config=CONFIG)

    assert refusals == ["refused: trainer.ppo_epochs: must be <= 100, got 1000000000"], refusals
    assert summary.steps == STEPS and answers[0].from_step == 2
    assert [s.live.get("trainer.lr") for s in standins.args("step")] == [None, None] + [5e-5] * 2


def test_a_run_recorded_before_the_fix_replays():
    """The first run of the stop test as the workflow recorded it before the fix: the stop
    arrived in step 1 and the run continued as new all the same. It replays (the new ending
    is behind `workflow.patched("stop-before-continue-as-new")`), so a worker with this code
    carries such a run on instead of failing its workflow task."""
    raw = gzip.decompress((Path(__file__).parent / "histories" / "stop-during-continue-as-new-step.json.gz").read_bytes()).decode()
    history = WorkflowHistory.from_json("old-stop-can", raw)
    kinds = [e.event_type for e in history.events]
    assert kinds.count(EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED) == 1  # the stop
    assert kinds[-1] == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW

    result = asyncio.run(Replayer(workflows=[TrainingWorkflow]).replay_workflow(history, raise_on_replay_failure=False))
    assert result.replay_failure is None, result.replay_failure
