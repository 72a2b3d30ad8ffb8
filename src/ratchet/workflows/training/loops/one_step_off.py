"""`one_step_off`: batch n+1 is generated with the weights of step n while step n trains;
the new weights are synced before the rollout after it starts. A deterministic run
generates batch k with version k - 1."""

from __future__ import annotations

import asyncio

from temporalio import workflow

from ratchet.types import LoopPlan, RunState

from ..boundary import step_boundary
from ..parts import RunParts


async def run(parts: RunParts, state: RunState, plan: LoopPlan) -> bool:
    steps = parts.steps
    while state.next_step < plan.steps and await step_boundary(parts):
        t0 = workflow.now()
        wait = 0.0
        if not state.ready:  # the first step (or a stop/continue left nothing ready)
            state.ready.append(await steps.rollout(state, plan))
            wait = (workflow.now() - t0).total_seconds()
        rounds = state.ready.pop(0)
        # Batch n+1 is generated with the weights the rollout holds now (step n's) while
        # step n trains; the sync after both brings the rollout to the new version.
        more = state.next_step + 1 < plan.steps and not parts.control.stopping
        training = asyncio.ensure_future(steps.train(state, rounds))
        generating = asyncio.ensure_future(steps.rollout(state, plan)) if more else None
        trained = await training
        if generating is not None:
            state.ready.append(await generating)
        synced = await steps.sync(state)
        await parts.recorder.record(state, plan, rounds, trained, synced, t0, trainer_wait=wait)
        if parts.continue_as_new_due(state, plan):
            return True
    return False
