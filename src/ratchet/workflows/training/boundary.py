"""The step boundary, where the commands a run received take effect: a sweep trial waits
at its rung for the verdict, a paused run waits, a drained node is moved off, live
changes apply, and a stop ends the loop. Every loop mode passes it before each step."""

from __future__ import annotations

from temporalio import workflow

from ratchet.types import EvacuateInput, EvacuateOutput, RunState
from ratchet.workflows import scheduling as sched
from ratchet.workflows import search_attributes as sa

from .parts import RunParts
from .patches import DRAIN_NODES


async def step_boundary(run: RunParts) -> bool:
    """Wait for the sweep's verdict at a trial's rung, then while paused; False once a stop
    was asked for."""
    control, state = run.control, run.scope.state
    if state is not None and control.holds_at(state, state.next_step):
        await _await_verdict(run, state)
    if control.paused and not control.stopping:
        if run.recorder.has_unwritten:  # no next step yet to write the last line
            await run.recorder.written()
        # The phase says "paused" for as long as the loop waits here, whatever a batch
        # still finishing in the background (fully_async) calls meanwhile.
        control.held_at_boundary = True
        run.recorder.show(sa.Status.PAUSED)
        try:
            await workflow.wait_condition(lambda: not control.paused or control.stopping)
        finally:
            control.held_at_boundary = False
        run.recorder.show(sa.Status.RUNNING)
    if control.draining and not control.stopping and state is not None and workflow.patched(DRAIN_NODES.name):
        await _move_off_draining_nodes(run, state)
    if not control.stopping and state is not None:
        run.live.apply(state)  # changes set since the last boundary start here
    return not control.stopping


async def _await_verdict(run: RunParts, state: RunState) -> None:
    """Wait at a rung for the sweep's `pass_rung` or `stop`. Without the wait a trial could
    run past its rung, or to its end, before the sweep had read its value there, and a
    trial the rule stops was never stopped."""
    rung, control = state.next_step, run.control
    await run.recorder.written()  # the sweep reads the rung's value from metrics.jsonl
    control.held_at_rung = rung
    try:
        await workflow.wait_condition(lambda: state.rung_passed >= rung or control.stopping)
    finally:
        control.held_at_rung = None


async def _move_off_draining_nodes(run: RunParts, state: RunState) -> None:
    """Checkpoint now (unless the step just ended with one, or nothing was trained yet),
    then release the actors on the draining nodes: the next step rebuilds them elsewhere
    from this checkpoint, with no update to replay. Generation is held meanwhile so no
    batch is cut off half made."""
    nodes, run.control.draining = list(run.control.draining), []
    await run.recorder.written()
    if state.next_step > 0 and not sched.checkpoint_due(run.scope.plan, state.next_step):
        await run.steps.checkpoint(state)
    async with run.steps.rollout_lock:
        await run.steps.call("evacuate_nodes", EvacuateInput(state.run, nodes), EvacuateOutput)
