"""Faults in and around the training workflow: a resumed run that continues as new, a bug
in workflow code, a failed or cancelled run's actors, and the size of the run state.

The workflow is the real one on a real Temporal dev server; the activities are stand-ins
(tests/faults/standins.py) because what is tested is the workflow's control flow, not Ray.
"""

from __future__ import annotations

import pytest
import asyncio

from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError
from temporalio.converter import default as default_converter
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError

from ratchet.platform.client import command_for
from ratchet.types import Progress, RunRef, RunState

from .standins import StandIns, plan, run_training, training_input


@pytest.mark.slow
def test_resumed_run_continuing_as_new_is_not_restored_again():
    """A run resumed from a checkpoint rebuilds its workers once; each continue-as-new after
    that carries the state on (it used to restore the old checkpoint at every one, killing
    the actors and an upload in flight, and moving the version floor)."""
    standins = StandIns()
    checkpoint_state = RunState(run=RunRef("resumed", "/nonexistent/resumed"), next_step=1, next_prompt=2, next_batch=1,
                                policy_version=1, rollout_version=1)  # fmt: skip
    inp = training_input("resumed", plan(steps=4, continue_as_new_every=1, checkpoint_every=1), resume=checkpoint_state, restore=True)
    summary = run_training(standins, inp)

    assert summary.steps == 4 and summary.policy_version == 4, summary
    # Steps 1..3, with a continue-as-new after steps 1 and 2: the workers were built once.
    assert standins.count("prepare_run") == 1
    assert [i.restore_version for i in standins.args("start_workers")] == [1]
    assert [i.policy_version for i in standins.args("train")] == [1, 2, 3]
    # The version floor set by the restore travels unchanged in the carried state.
    assert [c.state.version_floor for c in standins.args("checkpoint")] == [1, 1, 1]
    assert standins.count("release_run") == 0  # a completed run's actors go in finish_run


def test_bug_in_workflow_code_fails_the_run_instead_of_hanging_it():
    """`heartbeat_timeout_s=inf` (refused at submit; here straight into the workflow) makes
    `timedelta` raise inside workflow code. That used to fail the workflow *task*, retried
    forever while the run showed RUNNING; now the run fails, naming the error and the phase."""
    standins = StandIns()
    inp = training_input("bug", plan(heartbeat_timeout_s=float("inf")))
    err = run_training(standins, inp)

    assert isinstance(err, WorkflowFailureError), err
    cause = err.cause
    assert isinstance(cause, ApplicationError) and cause.type == "WorkflowBug", cause
    assert "OverflowError" in cause.message and "'admit_run'" in cause.message, cause.message  # its first heartbeating call
    assert [i.run_id for i in standins.args("release_run")] == ["bug"]


def test_failed_activity_releases_the_actors_and_fails_with_its_error():
    standins = StandIns(fail={"train": ApplicationError("trainer out of memory", type="TrainBoom", non_retryable=True)})
    err = run_training(standins, training_input("boom", plan()))

    assert isinstance(err, WorkflowFailureError), err
    assert isinstance(err.cause, ActivityError) and isinstance(err.cause.cause, ApplicationError)
    assert err.cause.cause.type == "TrainBoom" and "trainer out of memory" in err.cause.cause.message
    assert [i.run_id for i in standins.args("release_run")] == ["boom"]
    assert standins.count("train") == 1 and standins.count("finish_run") == 0


def test_cancelled_run_releases_its_actors():
    """A cancel lands while `generate` runs: the workflow still runs `release_run`, then ends
    as cancelled."""
    standins = StandIns(block=("generate",))
    statuses = []

    async def cancel_during_generate(handle):
        await asyncio.wait_for(standins.started["generate"].wait(), 60)
        await handle.cancel()
        try:
            await asyncio.wait_for(handle.result(), 60)
        except Exception:
            pass
        statuses.append((await handle.describe()).status)

    err = run_training(standins, training_input("cancelled", plan()), during=cancel_during_generate)

    assert isinstance(err, WorkflowFailureError) and isinstance(err.cause, CancelledError), err
    assert statuses == [WorkflowExecutionStatus.CANCELED]
    assert [i.run_id for i in standins.args("release_run")] == ["cancelled"]


def _old_summary(rewards: list[float]) -> tuple[float, float]:
    """What the workflow reported before the state was bounded (a list of every step's reward)."""

    def mean(xs):
        return sum(xs) / len(xs) if xs else 0.0

    return mean(rewards[:10]), mean(rewards[-10:])


def test_run_state_stays_small_after_100000_steps():
    """The run state travels in every continue-as-new and checkpoint: it must not grow with
    the run (Temporal refuses payloads over 2 MB). It used to keep one float per step."""
    state = RunState(run=RunRef("long", "/nonexistent/long"))
    rewards = [((i * 7919) % 1000) / 997.0 for i in range(100_000)]
    for step, reward in enumerate(rewards):
        state.record_reward(reward)
        if step % 10 == 0:
            state.record_eval(step, reward)
    payload = default_converter().payload_converter.to_payloads([state])[0]

    assert len(payload.data) < 16 * 1024, len(payload.data)
    first10, last10 = _old_summary(rewards)
    assert sum(state.reward_first10) / 10 == first10 and sum(state.reward_last10) / 10 == last10
    assert state.reward_count == 100_000 and state.latest_reward == rewards[-1]
    # The first evaluation (the baseline) and the latest ones are kept.
    assert "0" in state.eval_rewards and str(99_990) in state.eval_rewards


@pytest.mark.slow
def test_worker_restart_does_not_release_a_live_run():
    """A worker that shuts down evicts its workflows, which cancels their coroutines: that
    is not the run ending, and the cleanup must not kill the actors of a run that another
    worker carries on."""
    from datetime import timedelta

    from temporalio.testing import WorkflowEnvironment
    from temporalio.worker import Worker

    from ratchet.workflows.training import TrainingWorkflow

    from .standins import TASK_QUEUE, TEMPORAL, start

    first, second = StandIns(block=("generate",)), StandIns()

    def worker(client, standins):
        return Worker(client, task_queue=TASK_QUEUE, workflows=[TrainingWorkflow], activities=standins.activities(),
                      graceful_shutdown_timeout=timedelta(seconds=1))  # fmt: skip

    async def go():
        env = await WorkflowEnvironment.start_local(dev_server_existing_path=str(TEMPORAL), ui=False)
        try:
            async with worker(env.client, first):
                handle = await start(env.client, training_input("restarted", plan(steps=2, heartbeat_timeout_s=2.0)))
                await asyncio.wait_for(first.started["generate"].wait(), 60)
            async with worker(env.client, second):
                return await asyncio.wait_for(handle.result(), 120)
        finally:
            await env.shutdown()

    summary = asyncio.run(go())
    assert summary.steps == 2
    assert first.count("release_run") == 0 and second.count("release_run") == 0
    assert first.count("prepare_run") == 1 and second.count("prepare_run") == 0


@pytest.mark.slow
def test_a_sweep_trial_waits_at_its_rung_for_the_verdict():
    """A trial with rungs stops after the rung's steps, its metrics line written, until the
    sweep says `pass_rung` (it goes on, across continue-as-new) or `stop` (it ends there).
    Without the wait a trial with fast steps ran past its rung, or to its end, before the
    sweep read its value, and was never stopped (3 of 6 trials in one CI run)."""
    from .standins import dev_server, run_on

    async def held_at(handle, rung: int, standins: StandIns) -> None:
        for _ in range(600):
            progress = await handle.query("progress", result_type=Progress)
            if progress.phase == f"waiting for the sweep's verdict at step {rung}":
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"never held at step {rung}: {progress.phase!r}")
        await asyncio.sleep(0.5)  # held, not merely slow: nothing more runs meanwhile
        assert standins.count("step") == rung and [r.step for r in standins.args("record_step")] == list(range(rung))

    passed, stopped = StandIns(), StandIns()

    async def go():
        async with dev_server() as env:

            async def go_on(handle):
                await held_at(handle, 2, passed)
                await handle.signal("pass_rung", 2)

            async def stop_there(handle):
                await held_at(handle, 2, stopped)
                await handle.signal("stop", command_for(handle.id))

            hold = {"hold_at_steps": [2]}
            a = await run_on(env.client, passed, training_input("passed", plan(steps=4, continue_as_new_every=1), **hold), go_on)
            b = await run_on(env.client, stopped, training_input("stopped", plan(steps=4), **hold), stop_there)
            return a, b

    a, b = asyncio.run(go())
    assert a.steps == 4 and not a.stopped and passed.count("step") == 4
    assert b.steps == 2 and b.stopped and stopped.count("step") == 2
    # The step before the rung prefetches nothing: the step after it may never come.
    assert [s.next_prompt_start is None for s in stopped.args("step")] == [False, True]
