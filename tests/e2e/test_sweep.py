"""Sweeps are durable: a sweep of 3 trials (2 at a time, ASHA early stopping) completes
while its worker process is killed and the Temporal server restarted; every trial is in
the registry once, the stopped ones are marked pruned, the best trial is reported. And a
Temporal Schedule starts a run.

Services come from chaos_platform.py's ChaosPlatform (a Temporal dev server on a database
file, Ray, a worker process that this module kills and restarts). Pausing, resuming and
cancelling a whole sweep is tested on stand-in trials (tests/faults/test_sweep_steering.py):
how the sweep drives its trials needs no trial to train.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
from temporalio.service import RPCError

from ratchet.platform.client import RECIPE_PATH
from ratchet.registry.db import Registry
from tests.e2e.chaos_platform import ChaosPlatform

pytestmark = pytest.mark.integration

# Three trials: the Temporal restart waits for the third, and the seeded learning rates
# (2.7e-3, 2.7e-4, 8.5e-4) make ASHA (eta 2, KL lowest first) stop one whatever the order
# at the rung: trial 0 when trial 1 (3x lower rate) got there first, else trial 2, which
# starts only once one of them ended and so sees trial 1's value there.
TRIALS, PARALLEL, STEPS, RUNG = 3, 2, 6, 2


@pytest.fixture(scope="module")
def sweep_platform(assets):
    # The worker (a child process) and this test read the same registry.
    db_dir = Path(tempfile.mkdtemp(dir="/tmp", prefix="rt-sweep-reg-"))
    url = f"sqlite:///{db_dir}/registry.db"
    before = os.environ.get("RATCHET_REGISTRY_URL")
    os.environ["RATCHET_REGISTRY_URL"] = url
    p = ChaosPlatform(assets)
    p.registry_url = url
    try:
        yield p
    finally:
        p.close()
        if not os.environ.get("RATCHET_KEEP_TEST_STATE"):
            shutil.rmtree(db_dir, ignore_errors=True)
        if before is None:
            os.environ.pop("RATCHET_REGISTRY_URL", None)
        else:
            os.environ["RATCHET_REGISTRY_URL"] = before


def run_overrides(p: ChaosPlatform, steps: int = STEPS) -> list[str]:
    """The tiniest trial that still learns a little: 2 prompts x 2 samples a step."""
    train, evals = p.assets.data["copy"]
    return [
        f"model.path={p.assets.model}", f"data.train_files={train}", f"data.eval_files={evals}", "data.eval_size=4",
        f"storage.root={p.state / 'runs'}", "warmup.steps=2", "warmup.batch_size=16", "loop.prompts_per_step=2", "rollout.n=2",
        f"loop.steps={steps}", "checkpoint.every=0", "loop.heartbeat_timeout_s=5",
        # Two trials' actors on the 2-CPU Ray head at once (each reserves 1 by default).
        "resources.rollout_cpus=0.5", "resources.trainer_cpus=0.5", "tracking.mlflow=false",
    ]  # fmt: skip


def sweep_spec(p: ChaosPlatform) -> dict:
    return {
        "name": "chaos-sweep",
        "base": str(RECIPE_PATH),
        "overrides": run_overrides(p),
        "space": {"trainer.lr": {"low": 1e-4, "high": 3e-3, "log": True}},
        "search": "random",
        "trials": TRIALS,
        "parallelism": PARALLEL,
        "objective": {"metric": "eval_reward", "direction": "max"},
        # Compared at the rung: the KL to the reference after the first updates, which grows
        # with the learning rate and never ties (4-sample rewards often do, and a tie goes on).
        "early_stopping": {"rule": "asha", "rungs": [RUNG], "eta": 2, "metric": "kl", "direction": "min"},
        "poll_seconds": 0.5,
        "seed": 3,
    }


def trial_dirs(p: ChaosPlatform, sweep_id: str) -> list[Path]:
    return sorted((p.state / "runs").glob(f"{sweep_id}-t*"))


def steps_of(run_dir: Path) -> list[int]:
    try:
        return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    except FileNotFoundError:
        return []


def faults(p: ChaosPlatform, sweep_id: str, done: threading.Event) -> list[str]:
    """Kill the worker once the first trial trains; restart Temporal once a third trial started."""
    fired = []
    for name, ready, fault in (
        ("worker", lambda: any(steps_of(d) for d in trial_dirs(p, sweep_id)), p.kill_worker),
        ("temporal", lambda: len(trial_dirs(p, sweep_id)) >= 3, p.kill_temporal),
    ):
        while not ready() and not done.is_set():
            time.sleep(0.1)
        if done.is_set():
            break
        fault()
        fired.append(name)
    return fired


def result(p: ChaosPlatform, handle, timeout: float = 600.0):
    """The sweep's result; the client reconnects while the Temporal server restarts."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return handle.result(timeout=max(1.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - the server was killed under the long poll
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def max_running(p: ChaosPlatform, workflow_id: str) -> int:
    """The most child workflows open at once, from the sweep's history."""
    history = p.client._run(p.client._temporal.get_workflow_handle(workflow_id).fetch_history())
    running = peak = 0
    for e in history.events:
        if e.HasField("child_workflow_execution_started_event_attributes"):
            running += 1
            peak = max(peak, running)
        elif any(
            e.HasField(f"child_workflow_execution_{end}_event_attributes")
            for end in ("completed", "failed", "canceled", "terminated", "timed_out")
        ):
            running -= 1
    return peak


def test_sweep_survives_worker_and_server_restarts(sweep_platform):
    p = sweep_platform
    handle = p.client.sweep(sweep_spec(p))
    done = threading.Event()
    fired: list[str] = []
    injector = threading.Thread(target=lambda: fired.extend(faults(p, handle.sweep_id, done)), daemon=True)
    injector.start()
    try:
        summary = result(p, handle)
    finally:
        done.set()
        injector.join(60)
    assert fired == ["worker", "temporal"], fired
    assert summary.status == "completed"
    assert [t.trial_index for t in summary.trials] == list(range(TRIALS))

    # Every trial in the registry exactly once, as the sweep saw it.
    with Registry.open(p.registry_url) as reg:
        rows = reg.trials(handle.sweep_id)
        record = reg.sweep(handle.sweep_id)
    assert [r.trial_index for r in rows] == list(range(TRIALS))
    assert [r.run_id for r in rows] == [f"{handle.sweep_id}-t{k}" for k in range(TRIALS)]
    by_state = {t.trial_index: t.state for t in summary.trials}
    assert {r.trial_index: r.state for r in rows} == by_state
    assert set(by_state.values()) <= {"completed", "pruned"}, summary.trials

    # Every trial waited at the rung to be judged (fast trials used to finish unjudged).
    assert sorted(int(k) for k in handle.progress().rung_values[str(RUNG)]) == list(range(TRIALS))
    # Stopped trials are pruned at the rung and ran its steps only; the others ran them all.
    pruned = [t for t in summary.trials if t.state == "pruned"]
    assert pruned, "ASHA with eta 2 stops the trials below the first at the rung"
    for t in summary.trials:
        recorded = steps_of(p.state / "runs" / t.run_id)
        assert recorded == list(range(len(recorded))), f"trial {t.trial_index}: each step recorded once"
        if t.state == "pruned":
            assert t.pruned_at == RUNG == t.steps == len(recorded)
        else:
            assert t.steps == STEPS == len(recorded) and t.objective is not None
    # Trial 0 reaches the rung alone (the first there always goes on) or beside trial 1.
    completed = {t.trial_index: t.objective for t in summary.trials if t.state == "completed"}
    best = max(completed, key=lambda k: (completed[k], -k))
    assert summary.best is not None and summary.best.trial_index == best
    assert record.status == "completed" and record.best_trial_index == best
    assert {r.trial_index: r.objective_value for r in rows if r.state == "completed"} == pytest.approx(completed)

    # None ran twice: one workflow execution per trial id; at most PARALLEL at once.
    for t in summary.trials:
        runs = p.client._run(_count(p, t.run_id))
        assert runs == 1, f"trial {t.trial_index} has {runs} executions"
    assert max_running(p, handle.sweep_id) == PARALLEL

    # The sweep's history (restarts, rung watches cancelled and redone, signals) replays:
    # its workflow code is deterministic.
    from temporalio.worker import Replayer

    from ratchet.workflows.sweep import SweepWorkflow

    history = p.client._run(p.client._temporal.get_workflow_handle(handle.sweep_id).fetch_history())
    p.client._run(Replayer(workflows=[SweepWorkflow], data_converter=p.client._temporal.data_converter).replay_workflow(history))

    # The trials are found by their sweep in the Temporal UI's search attributes.
    query = f"ratchet_sweep = '{handle.sweep_id}'"
    assert eventually(lambda: p.client._run(_count_where(p, query)) == TRIALS), query
    progress = handle.progress()  # the query answers after the sweep closed too
    assert progress.status == "completed" and progress.best.trial_index == best and len(progress.finished) == TRIALS

    # `ratchet sweeps` shows it with its best trial; `ratchet sweeps ID` its trials.
    from typer.testing import CliRunner

    from ratchet.platform import cli

    # Wide enough that every table is drawn as a table (Rich reads COLUMNS at each print:
    # never pin the CLI console's width, later tests in this process would inherit it).
    wide = {"COLUMNS": "300"}
    listed = CliRunner().invoke(cli.app, ["sweeps", "--url", p.registry_url], env=wide)
    assert listed.exit_code == 0 and handle.sweep_id in listed.output and "completed" in listed.output, listed.output
    trials = CliRunner().invoke(cli.app, ["sweeps", handle.sweep_id, "--url", p.registry_url], env=wide)
    assert trials.exit_code == 0 and trials.output.count("pruned") == len(pruned) and "best" in trials.output, trials.output


async def _count(p: ChaosPlatform, workflow_id: str) -> int:
    return await _count_where(p, f"WorkflowId = '{workflow_id}'")


async def _count_where(p: ChaosPlatform, query: str) -> int:
    return len([w async for w in p.client._temporal.list_workflows(query)])


def test_schedule_starts_a_run(sweep_platform):
    from ratchet.platform.schedules import create_schedule, delete_schedule, launched_runs, list_schedules, trigger_schedule

    p = sweep_platform
    create_schedule(p.client, "nightly-copy", config=RECIPE_PATH, overrides=run_overrides(p, steps=2), every="1d", paused=True)
    assert eventually(lambda: [r.schedule_id for r in list_schedules(p.client)] == ["nightly-copy"])  # visibility lags
    trigger_schedule(p.client, "nightly-copy")
    deadline = time.monotonic() + 60
    while not (launched := launched_runs(p.client, "nightly-copy")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(launched) == 1 and launched[0].startswith("nightly-copy-"), launched
    assert eventually(lambda: p.client.get(launched[0]).status() != "UNKNOWN", 60)  # the launcher starts it
    summary = p.client.get(launched[0]).result(timeout=300)
    assert summary.run_id == launched[0] and summary.steps == 2
    assert steps_of(p.state / "runs" / launched[0]) == [0, 1]
    delete_schedule(p.client, "nightly-copy")
    assert eventually(lambda: list_schedules(p.client) == [])


def eventually(check, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return True
        except RPCError:  # not there yet
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
