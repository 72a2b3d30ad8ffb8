"""Steering a whole sweep: pause holds the running trial at a step boundary and starts no
other; resume lets it go on; cancel stops it (keeping what it did) and the sweep completes
as cancelled with no new trial, in the registry too.

The sweep workflow, its trials' training workflows and the sweep's own activities (Optuna,
the registry on a SQLite file) are the real ones on a real Temporal dev server; the
training activities are stand-ins (tests/faults/standins.py), because what is tested is
how the sweep drives its trials, not what a trial trains. tests/e2e/test_sweep.py runs a
real sweep, with real trials, through a killed worker and a restarted server.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from temporalio.worker import Worker

from ratchet.platform.client import RECIPE_PATH, command_for
from ratchet.sweep_types import SweepProgress, SweepSummary, trial_run_id
from ratchet.types import Progress

from ..configs import NO_TRACKER
from .standins import StandIns, dev_server

STEPS = 40


def spec(assets, root) -> dict:
    train, _ = assets.data["copy"]
    return {
        "name": "steered",
        "base": str(RECIPE_PATH),
        "overrides": [
            f"model.path={assets.model}",
            f"data.train_files={train}",
            "data.eval_files=null",
            f"storage.root={root}",
            f"loop.steps={STEPS}",
            "checkpoint.every=0",
            NO_TRACKER,
        ],
        "space": {"trainer.lr": {"low": 1e-4, "high": 3e-3, "log": True}},
        "search": "random",
        "trials": 3,
        "parallelism": 1,
        "objective": {"metric": "reward_mean", "direction": "max"},
        "early_stopping": {"rule": "none"},
        "seed": 3,
    }


async def until(check, what: str, limit_s: float = 60.0) -> None:
    """Poll `check` (a coroutine function) until it is true; a hang guard, not a timing."""
    for _ in range(int(limit_s / 0.05)):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never: {what}")


@pytest.mark.slow
def test_pause_resume_and_cancel_a_whole_sweep(assets, tmp_path, monkeypatch):
    from ratchet.activities.sweep_trials import SWEEP_ACTIVITIES
    from ratchet.platform.sweeps import prepare_sweep
    from ratchet.registry.db import Registry
    from ratchet.workflows.sweep import SweepWorkflow
    from ratchet.workflows.training import TrainingWorkflow

    registry_url = f"sqlite:///{tmp_path / 'registry.db'}"
    monkeypatch.setenv("RATCHET_REGISTRY_URL", registry_url)  # the sweep activities run in this process
    inp = prepare_sweep(spec(assets, tmp_path / "runs"))
    first = trial_run_id(inp.sweep_id, 0)
    # Steps that take a moment, so that the signals land while the trial trains.
    standins = StandIns(delay={"step": 0.05})

    def steps_of(run_id: str) -> int:
        return sum(1 for s in standins.args("step") if s.rollout.run.run_id == run_id)

    async def go() -> SweepSummary:
        async with dev_server() as env:
            client = env.client
            async with Worker(
                client,
                task_queue="sweeps",
                workflows=[SweepWorkflow, TrainingWorkflow],
                activities=[*standins.activities(), *SWEEP_ACTIVITIES],
                activity_executor=ThreadPoolExecutor(4),
                graceful_shutdown_timeout=timedelta(seconds=1),
            ):
                sweep = await client.start_workflow("SweepWorkflow", inp, id=inp.sweep_id, task_queue="sweeps", result_type=SweepSummary)
                trial = client.get_workflow_handle(first)

                async def progress() -> SweepProgress:
                    return await sweep.query("progress", result_type=SweepProgress)

                async def trained() -> bool:
                    return steps_of(first) >= 1

                await until(trained, "the first trial trains")
                await sweep.signal("pause", command_for(inp.sweep_id))

                async def paused() -> bool:
                    trial_phase = (await trial.query("progress", result_type=Progress)).phase
                    return (await progress()).status == "paused" and trial_phase == "paused"

                await until(paused, "the sweep and its trial paused")
                held = steps_of(first)
                await asyncio.sleep(0.5)  # held at a boundary: no step runs meanwhile
                assert steps_of(first) == held and (await progress()).running == [0]
                with Registry.open(registry_url) as reg:
                    assert reg.sweep(inp.sweep_id).status == "paused"

                await sweep.signal("resume", command_for(inp.sweep_id))

                async def going_on() -> bool:
                    return steps_of(first) > held

                await until(going_on, "the trial trains again")
                await sweep.signal("cancel", command_for(inp.sweep_id))
                return await asyncio.wait_for(sweep.result(), 60)

    summary = asyncio.run(go())
    assert summary.status == "cancelled"
    assert [(t.trial_index, t.state) for t in summary.trials] == [(0, "cancelled")]  # trials 1 and 2 never started
    assert 0 < summary.trials[0].steps < STEPS and summary.best is None
    assert {s.rollout.run.run_id for s in standins.args("step")} == {first}
    assert [i.run_id for i in standins.args("prepare_run")] == [first]
    with Registry.open(registry_url) as reg:
        assert reg.sweep(inp.sweep_id).status == "cancelled"
        assert [(r.trial_index, r.state) for r in reg.trials(inp.sweep_id)] == [(0, "failed")]  # the registry has no "cancelled" trial
