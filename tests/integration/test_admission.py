"""Runs are admitted to the cluster whole, first come first served (the issue: two runs on a
2-CPU Ray took one CPU each and waited forever for the second).

The ledger's rules (src/ratchet/workers/actors/admission.py) as plain objects with made-up
cluster resources; then real runs (Temporal, Ray, the worker process) that each need every
CPU of the test cluster: they run one after another, the queued ones show their place, and
a stop on a queued run ends it at once without building anything.
"""

from __future__ import annotations

import os

import pytest

from ratchet.platform.client import RECIPE_PATH, command_for
from ratchet.workers.admission_ledger import REBUILT_HOLD_S, AdmissionLedger, Need

from ..polling import wait_until


class Cluster:
    """Made-up Ray resources: `free` is what Ray would say is free now."""

    def __init__(self, cpus: float, gpus: float = 0.0):
        self.total = {"CPU": cpus, "GPU": gpus}
        self.free = dict(self.total)
        self.now = 0.0

    def resources(self):
        return self.total, self.free

    def ledger(self) -> AdmissionLedger:
        return AdmissionLedger(self.resources, clock=lambda: self.now, wall=lambda: 1000.0 + self.now)


def test_whole_runs_are_admitted_first_come_first_served():
    cluster = Cluster(4)
    ledger = cluster.ledger()
    two = Need(2)
    assert ledger.request("a", two).admitted and ledger.request("b", two).admitted  # both fit: both run
    cluster.free["CPU"] = 0.0  # their actors hold every CPU
    c = ledger.request("c", two)
    cluster.now += 1
    d = ledger.request("d", Need(1))
    assert (c.admitted, c.ahead, d.admitted, d.ahead) == (False, 0, False, 1)
    assert c.status == "waiting for 2 CPUs; 0 runs ahead; running: a, b"
    assert d.status == "waiting for 1 CPU; 1 run ahead; running: a, b"
    assert ledger.request("c", two, c.queued_at).status == c.status  # asking again keeps the place

    # A killed actor frees its CPUs in Ray, not its run's grant: nobody is admitted into them.
    cluster.free["CPU"] = 1.0
    assert not ledger.request("c", two).admitted and not ledger.request("d", Need(1)).admitted

    # Run a ends: c (first in line) is admitted; d, which would fit beside it, waits its turn.
    assert ledger.leave("a")
    cluster.free["CPU"] = 2.0
    assert ledger.request("c", two).admitted
    assert ledger.granted() == {"b": two, "c": two}
    cluster.free["CPU"] = 0.0
    assert ledger.request("d", Need(1)).status == "waiting for 1 CPU; 0 runs ahead; running: b, c"

    # A big run at the head is not overtaken by a small one behind it.
    ledger.leave("b")
    cluster.free["CPU"] = 2.0
    assert ledger.request("d", Need(1)).admitted
    cluster.free["CPU"] = 1.0
    big, small = ledger.request("big", Need(3)), ledger.request("small", Need(1))
    assert not big.admitted and not small.admitted and small.ahead == 1
    assert not ledger.leave("never-queued") and ledger.leave("big")
    assert ledger.request("small", Need(1)).admitted


def test_cpus_held_outside_the_queue_keep_the_head_waiting_and_gpus_count_too():
    cluster = Cluster(2, gpus=1)
    ledger = cluster.ledger()
    cluster.free["CPU"] = 0.5  # another Ray job, or leftovers being swept
    got = ledger.request("a", Need(2))
    assert not got.admitted
    assert got.status == "waiting for 2 CPUs; 0 runs ahead; Ray has 0.5 CPUs free (CPUs held outside the queue)"
    # Its own live actors (a retried start) count as free for it.
    assert ledger.request("a", Need(2, 1), held=Need(1.5, 1)).admitted
    gpu = ledger.request("g", Need(0, 1))
    assert not gpu.admitted and gpu.status == "waiting for 1 GPU; 0 runs ahead; running: a"
    cluster.free["CPU"] = 0.0
    ledger.leave("a")
    assert ledger.request("g", Need(0, 1)).admitted  # needs no CPU
    assert not ledger.request("h", Need(1, 1)).admitted and Need(1, 1).text() == "1 CPU and 1 GPU"


def test_a_place_not_renewed_expires_and_a_rebuilt_ledger_keeps_the_order():
    cluster = Cluster(2)
    ledger = cluster.ledger()
    assert ledger.request("a", Need(2)).admitted
    cluster.free["CPU"] = 0.0
    first = ledger.request("b", Need(2), lease_s=5)
    cluster.now += 1
    second = ledger.request("c", Need(2), lease_s=30)
    assert second.ahead == 1
    cluster.now += 6  # b's activity is gone (its run terminated, its worker died)
    assert ledger.queue() == [("c", Need(2), second.queued_at)]
    assert ledger.request("c", Need(2)).ahead == 0

    # The ledger is lost with the Ray head. The runs come back in any order, with the time
    # they first queued: the order stands; running runs reclaim their grants first.
    cluster = Cluster(2)
    cluster.now = 100.0
    rebuilt = cluster.ledger()
    rebuilt.request("c", Need(2), second.queued_at)
    early = rebuilt.request("b", Need(2), first.queued_at)
    late = rebuilt.request("c", Need(2), second.queued_at)
    assert (early.ahead, late.ahead, early.admitted, late.admitted) == (0, 1, False, False)
    assert "the queue was rebuilt (Ray head restarted)" in early.status
    assert rebuilt.reclaim("a", Need(2)) and not rebuilt.reclaim("a", Need(2))
    cluster.free["CPU"] = 0.0
    cluster.now += REBUILT_HOLD_S
    assert not rebuilt.request("b", Need(2), first.queued_at).admitted  # a holds the CPUs again
    rebuilt.leave("a")
    cluster.free["CPU"] = 2.0
    assert rebuilt.request("b", Need(2), first.queued_at).admitted


# -- the workflow in the queue (stand-in activities: tests/faults/standins.py) ---------------


def test_a_queued_run_shows_its_place_and_a_stop_or_cancel_leaves_the_queue():
    """admit_run answers "still queued" (with its place) until the workflow leaves: a stop
    completes the run as stopped with nothing built; a cancel ends it as cancelled. Either
    way release_run gives the place back and no warm-up or worker ever starts."""
    import asyncio

    from temporalio.client import WorkflowFailureError
    from temporalio.exceptions import CancelledError

    from ratchet.admission_types import AdmitOutput

    from ..faults.standins import StandIns, dev_server, plan, run_on, training_input

    waiting = "waiting for 2 CPUs; 1 run ahead; running: other"

    def standins() -> StandIns:
        return StandIns(answers={"admit_run": lambda i: AdmitOutput(False, waiting, 7.0)}, delay={"admit_run": 0.2})

    async def go():
        async with dev_server() as env:
            seen = []

            def leave_by(how: str):
                async def during(handle):
                    async def shown():
                        while (await handle.query("progress"))["phase"] != f"queued: {waiting}":
                            await asyncio.sleep(0.1)

                    await asyncio.wait_for(shown(), 30)
                    seen.append(how)
                    await (handle.signal("stop", command_for(handle.id)) if how == "stop" else handle.cancel())

                return during

            stopped, cancelled = standins(), standins()
            summary = await run_on(env.client, stopped, training_input("q-stop", plan()), leave_by("stop"))
            try:
                await run_on(env.client, cancelled, training_input("q-cancel", plan()), leave_by("cancel"))
            except WorkflowFailureError as exc:
                error = exc
            return summary, error, stopped, cancelled, seen

    summary, error, stopped, cancelled, seen = asyncio.run(go())
    assert seen == ["stop", "cancel"]
    assert summary.stopped and summary.steps == 0 and summary.final_policy_uri == ""
    assert isinstance(error.cause, CancelledError), error
    for run, reason in ((stopped, "stopped"), (cancelled, "cancelled")):
        assert {name for name, _ in run.calls} == {"prepare_run", "admit_run", "release_run"}
        assert [i.reason for i in run.args("release_run")] == [reason]
        asks = run.args("admit_run")
        # The first ask knows nothing; the next ones carry the place the run was given.
        assert (asks[0].status, asks[0].queued_at) == ("", 0.0) and (asks[1].status, asks[1].queued_at) == (waiting, 7.0)


# -- real runs -----------------------------------------------------------------------------

# The platform's Ray head has one CPU per core; each run needs all of them.
CPUS = os.cpu_count() or 1
ROLLOUT_CPUS = 1.0 if CPUS > 1 else 0.5
RUN = [
    "warmup.steps=0", "data.eval_files=null", "loop.steps=2", "loop.prompts_per_step=4", "rollout.n=2",
    "rollout.max_response_length=8", "checkpoint.every=0", f"resources.trainer_cpus={max(CPUS - ROLLOUT_CPUS, 0.5):g}",
    f"resources.rollout_cpus={ROLLOUT_CPUS:g}",
]  # fmt: skip


def _activities(handle) -> list[tuple[str, str, float]]:
    """(activity type, "scheduled" | "completed", event time) of the run's activity events."""
    from temporalio.api.enums.v1 import EventType

    events = handle.history().events
    names = {
        e.event_id: e.activity_task_scheduled_event_attributes.activity_type.name
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    }
    out = []
    for e in events:
        t = e.event_time.ToDatetime().timestamp()
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            out.append((names[e.event_id], "scheduled", t))
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            out.append((names[e.activity_task_completed_event_attributes.scheduled_event_id], "completed", t))
    return out


def _held(handle) -> tuple[float, float]:
    """From start_workers scheduled to finish_run completed: while the run held its actors."""
    events = _activities(handle)
    start = next(t for name, kind, t in events if name == "start_workers" and kind == "scheduled")
    end = next(t for name, kind, t in events if name == "finish_run" and kind == "completed")
    return start, end


def test_runs_that_each_need_the_whole_cluster_run_one_after_another(platform, ray_driver):
    from temporalio.client import WorkflowFailureError

    from ratchet.workers.actors import admission, release_run_actors, run_actor_names

    client = platform.client
    need = f"{CPUS:g} CPU{'' if CPUS == 1 else 's'}"
    handles = []

    def submit(name: str):
        handles.append(client.submit(RECIPE_PATH, platform.overrides(*RUN, f"tracking.name={name}")))
        return handles[-1]

    def phase(handle) -> str:
        return handle.progress().phase

    try:
        # More than the whole cluster: no queue could help, it fails at once, naming the fields.
        huge = client.submit(RECIPE_PATH, platform.overrides(*RUN, f"resources.trainer_cpus={CPUS:g}", "tracking.name=adm-huge"))
        with pytest.raises(WorkflowFailureError) as info:
            huge.result(timeout=60)
        cause = info.value.cause.cause  # the admit_run activity's failure
        assert cause.type == "ResourcesUnavailable" and cause.non_retryable
        assert cause.message.startswith(f"run {huge.run_id} needs {CPUS + ROLLOUT_CPUS:g} Ray CPUs (resources.trainer_cpus x ")
        assert cause.message.endswith(f"but the cluster has {CPUS:g}; lower the resources.* values or add nodes")

        first = submit("adm-first")
        first.pause()  # it keeps its CPUs at its first step boundary while the others queue
        wait_until(lambda: phase(first) == "paused", timeout=120)
        queued = []
        # Two queued behind it, each shown its place. Only the first of them runs later: a
        # third run in the chain would show nothing the ledger's own tests above do not
        # (the order among many queued runs) and cost a run's three actor starts.
        for ahead, name in enumerate(("adm-second", "adm-stopped")):
            run = submit(name)
            shown = f"queued: waiting for {need}; {ahead} run{'' if ahead == 1 else 's'} ahead; running: {first.run_id}"
            wait_until(lambda: phase(run) == shown, timeout=60)
            queued.append(run)
        second, stopped = queued

        # A stop on a queued run ends it at once: the first run still holds every CPU.
        stopped.stop()
        summary = stopped.result(timeout=60)
        assert summary.stopped and summary.steps == 0 and summary.final_policy_uri == ""
        assert first.running() and phase(first) == "paused"
        assert {name for name, _, _ in _activities(stopped)} == {"prepare_run", "admit_run", "release_run"}
        assert stopped.run_id not in admission.ledger_runs() and stopped.run_id not in run_actor_names()
        assert stopped.progress().phase == "stopped"

        # Terminated while queued (no workflow code runs): its waiting attempt finds the
        # workflow gone at its next heartbeat and gives the place back.
        terminated = submit("adm-terminated")
        wait_until(lambda: phase(terminated).startswith("queued: ") and terminated.run_id in admission.ledger_runs(), timeout=60)
        client._run(client._temporal.get_workflow_handle(terminated.run_id).terminate("test: a queued run terminated"))
        # Well before its place would expire.
        wait_until(lambda: terminated.run_id not in admission.ledger_runs(), timeout=admission.LEASE_S / 2)
        assert terminated.run_id not in run_actor_names()

        first.resume()
        results = [h.result(timeout=300) for h in (first, second)]
        assert [(r.steps, r.stopped) for r in results] == [(2, False)] * 2
        spans = [_held(h) for h in (first, second)]

        # One after another: the queued run started after the one holding the cluster ended.
        assert spans[0][1] <= spans[1][0], spans
        assert admission.ledger_runs() == []
    finally:
        for h in handles:
            if h.running():
                h.cancel()
        for h in handles:
            release_run_actors(h.run_id)
