"""`sync`: per step rollout, score, train, sync, in order (the on-policy baseline). With
one sampling round the step is one `step` activity that hands the batch between the actors
in memory (activities/training.py); DAPO's refills decide between rounds, so a step with
several rounds calls each phase on its own. A deterministic run generates batch k with
version k (always so in this mode)."""

from __future__ import annotations

from temporalio import workflow

from ratchet.types import LoopPlan, RunState

from ..boundary import step_boundary
from ..parts import RunParts
from ..patches import FUSED_SYNC_STEP


async def run(parts: RunParts, state: RunState, plan: LoopPlan) -> bool:
    steps = parts.steps
    while state.next_step < plan.steps and await step_boundary(parts):
        t0 = workflow.now()
        fused = plan.sampling_rounds == 1 and workflow.patched(FUSED_SYNC_STEP.name)
        if fused:
            prefetch = parts.control.may_prefetch(state, plan)
            rounds, trained, synced = await steps.fused_step(state, plan, record=parts.recorder.take_unwritten(), prefetch=prefetch)
        else:
            rounds = await steps.rollout(state, plan)
            trained = await steps.train(state, rounds)
            synced = await steps.sync(state)
        await parts.recorder.record(state, plan, rounds, trained, synced, t0, trainer_wait=0.0, next_step_writes=fused)
        if parts.continue_as_new_due(state, plan):
            return True
    return False
