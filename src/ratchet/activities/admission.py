"""The `admit_run` activity: a run waits in the cluster's admission queue until it gets
everything it needs at once (workers/actors/admission.py says why and how).

An attempt answers as soon as the run is admitted or its place in the queue changes (the
workflow shows the new status in its progress and asks again), and at least every
`RETURN_AFTER_S`, so its time limit never ends a long wait. While nothing changes it
holds no activity slot: a queue of many runs must not take the slots that the running
runs' steps need. It completes asynchronously (Temporal's async activity completion),
from a task in this worker process that polls the queue and heartbeats; if this process
dies, the heartbeats stop and Temporal retries the attempt elsewhere (the run keeps its
place: `queued_at`).

Leaving the queue: a cancelled attempt (the workflow was stopped or cancelled, or its
heartbeat finds the workflow gone: terminated) gives up its place at once; an attempt
that just vanished loses it after the ledger's lease (`LEASE_S`, 60 s). While it waits, the runs
that hold the CPUs it waits for are checked now and then: one whose workflow is closed
(terminated from outside) has its actors and grant released there and then, not at the
next sweep.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from temporalio import activity
from temporalio.client import AsyncActivityCancelledError, Client
from temporalio.service import RPCError, RPCStatusCode

from ratchet.admission_types import AdmitInput, AdmitOutput
from ratchet.config.placement_plan import PlacementPlan, plan_placement
from ratchet.config.schema import RunConfig
from ratchet.errors import DomainError
from ratchet.ids import check_id
from ratchet.workers.actors import admission, placement, release_run_actors

from .run_config import stored_run_config
from .translate import domain_error

log = logging.getLogger(__name__)

POLL_S = 1.0
# An attempt returns at least this often while the run waits (the time limit is 10 minutes).
RETURN_AFTER_S = 240.0
# How often a waiting run checks whether the runs ahead of it (or holding the CPUs) are still open.
CHECK_HOLDERS_S = 10.0
# Waits completing asynchronously: referenced here until they are done.
_WAITS: set[asyncio.Task] = set()


@dataclass
class _Run:
    run_id: str
    cfg: RunConfig
    plan: PlacementPlan
    need: admission.Need

    async def ask(self, queued_at: float) -> admission.Admission:
        held = await asyncio.to_thread(placement.held_by_run, self.run_id, self.cfg, self.plan)
        return await asyncio.to_thread(admission.request, self.run_id, self.need, queued_at, held)


@activity.defn(name="admit_run")
async def admit_run(inp: AdmitInput) -> AdmitOutput:
    """Admitted, or the run's new place in the queue; ResourcesUnavailable (not retried)
    when the cluster can never hold the run."""
    try:
        run = await _run(inp)
        got = await run.ask(inp.queued_at)
    except DomainError as exc:
        raise domain_error(exc) from exc
    except asyncio.CancelledError:
        await _leave(check_id(inp.run.run_id))
        raise
    if got.admitted or got.status != inp.status:
        return _output(got)
    # Nothing changed: wait without holding a slot of this worker.
    wait = asyncio.create_task(_wait(activity.client(), activity.info().task_token, run, got, inp.status))
    _WAITS.add(wait)
    wait.add_done_callback(_WAITS.discard)
    activity.raise_complete_async()
    raise AssertionError("unreachable: raise_complete_async raises")  # said for the type checker


async def _run(inp: AdmitInput) -> _Run:
    run_id = check_id(inp.run.run_id)
    cfg = await asyncio.to_thread(stored_run_config, inp.run.run_uri, inp.run.config_id)
    plan = plan_placement(cfg)
    await asyncio.to_thread(placement.check_never_fits, run_id, cfg, plan)
    return _Run(run_id, cfg, plan, placement.run_need(cfg, plan))


def _output(got: admission.Admission) -> AdmitOutput:
    return AdmitOutput(admitted=got.admitted, status=got.status, queued_at=got.queued_at)


async def _wait(client: Client, task_token: bytes, run: _Run, got: admission.Admission, shown: str) -> None:
    """Poll the queue until the run is admitted or its status changes, heartbeating the
    attempt; complete it then."""
    handle = client.get_async_activity_handle(task_token=task_token)
    loop = asyncio.get_running_loop()
    until = loop.time() + RETURN_AFTER_S
    check_at = loop.time()
    try:
        while True:
            await handle.heartbeat(got.status)  # AsyncActivityCancelledError once cancelled
            if loop.time() >= check_at:
                check_at = loop.time() + CHECK_HOLDERS_S
                await _release_closed_blockers(client, run.run_id)
            await asyncio.sleep(POLL_S)
            got = await run.ask(got.queued_at)
            if got.admitted or got.status != shown or loop.time() >= until:
                await handle.complete(_output(got))
                return
    except AsyncActivityCancelledError:
        await _leave(run.run_id)
        await _quietly(handle.report_cancellation())
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            # The workflow is gone (terminated), or only this attempt (timed out: the next
            # one asks again with the run's place, `queued_at`).
            if not await _still_open(client, run.run_id):
                await _leave(run.run_id)
            return
        log.warning("run %s: waiting in the admission queue: %s", run.run_id, exc)
        await _quietly(handle.fail(exc))
    except Exception as exc:  # noqa: BLE001 - the attempt fails (and is retried) instead of hanging
        log.warning("run %s: waiting in the admission queue failed", run.run_id, exc_info=True)
        await _quietly(handle.fail(exc))


async def _still_open(client: Client, run_id: str) -> bool:
    from .sweep import run_is_open

    return await run_is_open(client, run_id)


async def _release_closed_blockers(client: Client, run_id: str) -> None:
    """Release the grants (and actors) of closed runs that hold CPUs this run waits for, and
    the places of closed runs ahead of it: a run terminated from outside ran no code to do it."""
    from .sweep import run_is_open

    granted = await asyncio.to_thread(admission.granted)
    queue = await asyncio.to_thread(admission.queue)
    ahead = [r for r, _, _ in queue[: next((i for i, (r, _, _) in enumerate(queue) if r == run_id), len(queue))]]
    for other in [*sorted(granted), *ahead]:
        if other != run_id and not await run_is_open(client, other):
            killed = await asyncio.to_thread(release_run_actors, other)
            released = ", ".join(killed) or "no actors"
            log.warning("run %s is closed but held its place or its CPUs; released it (%s)", other, released)


async def _leave(run_id: str) -> None:
    try:
        await asyncio.to_thread(admission.leave, run_id)
    except Exception:  # noqa: BLE001 - the lease drops the entry anyway
        log.warning("run %s: leaving the admission queue failed; its place expires in %g s", run_id, admission.LEASE_S, exc_info=True)


async def _quietly(call) -> None:
    try:
        await call
    except Exception:  # noqa: BLE001 - the attempt times out on its own
        log.warning("reporting to an admission attempt failed", exc_info=True)
