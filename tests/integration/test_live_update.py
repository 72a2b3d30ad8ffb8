"""The `set_params` update through the real training workflow on a real Temporal dev server,
with the stand-in activities of tests/faults/standins.py (no Ray, no torch: seconds).

A refused change (a key that cannot change live, a value its field refuses) is answered
with its reason and never enters the history; an accepted one is an update in the history,
reaches every step's activity input from the step it applies from, across continue-as-new,
and marks that step's metrics line. The end-to-end run (a real trainer that is killed and
rebuilt) is tests/e2e/test_live_and_fork.py.
"""

from __future__ import annotations

import asyncio

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowUpdateFailedError
from temporalio.worker import Replayer

from ratchet.platform.client import command_for
from ratchet import types as t
from ratchet.config import RunConfig
from ratchet.workflows.training import TrainingWorkflow

import pytest_asyncio

from ..faults.standins import StandIns, dev_server, plan, run_on

pytestmark = pytest.mark.asyncio(loop_scope="module")

CONFIG = RunConfig.model_validate(
    {"model": {"path": "m"}, "data": {"train_files": "t.jsonl"}, "algorithm": {"kl": {"coef": 0.01}}}
).model_dump(mode="json")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client():
    async with dev_server() as env:
        yield env.client


async def wait_paused(handle) -> int:
    while True:
        progress = await handle.query("progress", result_type=t.Progress)
        if progress.phase == "paused":
            return progress.step
        await asyncio.sleep(0.02)


@pytest.mark.slow
async def test_live_change_is_checked_recorded_and_carried_across_continue_as_new(client):
    standins = StandIns(delay={"train": 0.05})
    inp = t.TrainingInput(run_id="live-1", config=CONFIG, plan=plan(steps=6, continue_as_new_every=2, kl_coef=0.01))
    seen: dict = {}

    async def during(handle):
        await standins.started["step"].wait()
        await handle.signal("pause", command_for(handle.id))
        seen["paused_at"] = await wait_paused(handle)
        for bad, why in [
            ({"rollout.temperature": 0.5}, "rollout.temperature: cannot change while the run trains"),
            ({"trainer.lr": -1.0}, "trainer.lr: must be > 0.0, got -1.0"),
            ({"trainer.nope": 1}, "trainer.nope: cannot change while the run trains"),
        ]:
            with pytest.raises(WorkflowUpdateFailedError) as refused:
                await handle.execute_update("set_params", bad, result_type=t.LiveChange)
            assert why in refused.value.cause.message, refused.value.cause.message
        seen["change"] = await handle.execute_update(
            "set_params", {"trainer.lr": "2e-5", "algorithm.kl.coef": 0.05}, result_type=t.LiveChange
        )
        seen["history"] = await handle.fetch_history()
        seen["run"] = (await handle.describe()).run_id  # the workflow run (of the continue-as-new chain) it went to
        await handle.signal("resume", command_for(handle.id))

    summary = await run_on(client, standins, inp, during)
    assert summary.steps == 6
    change: t.LiveChange = seen["change"]
    first = seen["paused_at"]
    assert 1 <= first < 6 and change.from_step == first, "paused at a boundary: the change applies to the next step"
    assert change.values == {"trainer.lr": 2e-5, "algorithm.kl.coef": 0.05}
    assert change.previous == {"trainer.lr": 1e-4, "algorithm.kl.coef": 0.01}

    steps = standins.args("step")
    assert [s.rollout.batch_index for s in steps] == list(range(6))
    assert [s.live for s in steps] == [{}] * first + [{"trainer.lr": 2e-5, "algorithm.kl.coef": 0.05}] * (6 - first)
    assert [s.kl_coef for s in steps] == [0.01] * first + [0.05] * (6 - first)
    records = sorted(standins.args("record_step"), key=lambda r: r.step)
    assert [r.metrics.get("live_changed") for r in records] == [None] * first + [1.0] + [None] * (5 - first)
    assert [r.metrics.get("trainer.lr") for r in records] == [None] * first + [2e-5] * (6 - first)

    # The one accepted update is in the history; the refused ones are not.
    events = seen["history"].events
    accepted = [e for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED]
    assert len(accepted) == 1
    assert b"2e-5" in accepted[0].workflow_execution_update_accepted_event_attributes.accepted_request.input.args.payloads[0].data
    assert not [e for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_REJECTED]

    # That workflow run's whole history (through its continue-as-new) replays deterministically.
    history = await client.get_workflow_handle(inp.run_id, run_id=seen["run"]).fetch_history()
    await Replayer(workflows=[TrainingWorkflow]).replay_workflow(history)


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
async def test_every_update_from_the_change_on_gets_the_values(client, mode):
    """The per-phase `train` activity (async modes) carries the values like sync's `step`."""
    standins = StandIns(delay={"train": 0.05})
    inp = t.TrainingInput(run_id=f"live-{mode}", config=CONFIG, plan=plan(steps=5, mode=mode, max_staleness=2, queue_limit=2))
    seen: dict = {}

    async def during(handle):
        await standins.started["train"].wait()
        await handle.signal("pause", command_for(handle.id))
        await wait_paused(handle)
        seen["change"] = await handle.execute_update("set_params", {"algorithm.entropy_coeff": 0.01}, result_type=t.LiveChange)
        await handle.signal("resume", command_for(handle.id))

    summary = await run_on(client, standins, inp, during)
    first = seen["change"].from_step
    assert summary.steps == 5 and 1 <= first < 5
    trains = standins.args("train")
    assert [tr.policy_version for tr in trains] == list(range(5))  # one update per step, in order
    assert [tr.live for tr in trains] == [{}] * first + [{"algorithm.entropy_coeff": 0.01}] * (5 - first)
    records = sorted(standins.args("record_step"), key=lambda r: r.step)
    assert [r.step for r in records if r.metrics.get("live_changed")] == [first]
