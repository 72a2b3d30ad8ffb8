"""`fully_async`: a producer keeps rollouts running ahead of the trainer; a batch starts
only if it will be at most `max_staleness` versions old when trained, the trainer takes
ready batches oldest first, drops (and redoes) any that are staler, and weights sync every
`sync_every` updates. With partial rollouts the sync does not wait for the generation in
flight: the engine takes the new weights between two decode steps and carries on.

A deterministic run generates batch k with the newest sync point at or before k - lag,
lag = min(max_staleness - sync_every + 1, queue_limit - 1) (the deepest pipeline that
never exceeds the staleness bound), syncs exactly every `sync_every` versions, and has no
partial rollouts. The maths is scheduling.py's; this is the orchestration.
"""

from __future__ import annotations

import asyncio

from temporalio import workflow

from ratchet.types import LoopPlan, RunState
from ratchet.workflows import scheduling as sched

from ..boundary import step_boundary
from ..parts import RunParts


async def run(parts: RunParts, state: RunState, plan: LoopPlan) -> bool:
    return await FullyAsyncLoop(parts, state, plan).run()


class FullyAsyncLoop:
    """The trainer's loop and the producer beside it, with what the producer's admission
    rule (`scheduling.may_start`) reads of the trainer."""

    def __init__(self, parts: RunParts, state: RunState, plan: LoopPlan) -> None:
        self.parts, self.state, self.plan = parts, state, plan
        self.stopping_producer = False  # the trainer is done: stop producing
        self.training = False  # an update is running
        self.trained_unrecorded = False  # updated, its step not counted yet

    async def run(self) -> bool:
        parts, state, plan, steps = self.parts, self.state, self.plan, self.parts.steps
        producer = asyncio.ensure_future(self._produce())
        updates_since_sync = 0
        can = False
        # With partial rollouts a sync runs while the next update does: the rollout worker
        # orders it against its generation, and it pushes whatever version the trainer holds.
        syncing: asyncio.Future | None = None
        try:
            while state.next_step < plan.steps and await step_boundary(parts):
                t0 = workflow.now()
                await workflow.wait_condition(lambda: bool(state.ready) or producer.done())
                if not state.ready:
                    break  # the producer ended (stop signal)
                wait = (workflow.now() - t0).total_seconds()
                rounds = state.ready.pop(0)
                staleness = state.policy_version - rounds[0].batch.policy_version
                if staleness > plan.max_staleness:
                    # Never trained on silently: counted, and its prompts are rolled out again.
                    state.dropped_samples += sched.num_samples(rounds)
                    state.retry_prompts.extend(r.batch.prompt_start for r in rounds)
                    continue
                self.training = True
                trained = await steps.train(state, rounds)
                self.training, self.trained_unrecorded = False, True
                updates_since_sync += 1
                synced = None
                if sched.sync_due(plan, state.policy_version, updates_since_sync):
                    if plan.partial_rollout:
                        synced = await syncing if syncing is not None else None  # one in flight at a time
                        syncing = asyncio.ensure_future(steps.sync(state))
                    else:
                        synced = await steps.sync(state)
                    updates_since_sync = 0
                self.trained_unrecorded = False  # counted by the record below, before it yields
                await parts.recorder.record(state, plan, rounds, trained, synced, t0, trainer_wait=wait, staleness=staleness)
                if parts.continue_as_new_due(state, plan):
                    can = True
                    break
        finally:
            self.stopping_producer = True
            if syncing is not None:
                await syncing
        # Batches the producer finishes stay in state.ready (carried on continue-as-new). The
        # final evaluation loads the latest weights itself; the export reads the trainer.
        await producer
        return can

    def _may_start(self) -> bool:
        return sched.may_start(
            self.plan, self.state, in_flight=len(self.parts.steps.in_flight), training=self.training,
            trained_unrecorded=self.trained_unrecorded,
        )  # fmt: skip

    async def _produce(self) -> None:
        """Keep rollouts going while staleness and the queue allow."""
        control = self.parts.control
        # A batch is scored while the next one is generated: the reward worker does not
        # need the rollout engine. Batches still enter `ready` in order.
        previous: asyncio.Future | None = None
        try:
            while True:
                await workflow.wait_condition(
                    lambda: self.stopping_producer or control.stopping or (not control.paused and self._may_start())
                )
                if self.stopping_producer or control.stopping:
                    return
                generated = asyncio.Event()
                previous = asyncio.ensure_future(self._produce_one(generated, previous))
                await generated.wait()
                if previous.done():
                    previous.result()  # a failed rollout fails the run now, not at the end
        finally:
            if previous is not None:
                await previous

    async def _produce_one(self, generated: asyncio.Event, before) -> None:
        steps, state = self.parts.steps, self.state
        rounds = await steps.rollout(state, self.plan, generated=generated)
        if before is not None and not before.done():
            # Until it is in `ready`, a checkpoint must still see it (as in flight).
            index = rounds[0].batch.index
            steps.in_flight[index] = rounds[0].batch.policy_version
            steps.in_flight_prompts[index] = [r.batch.prompt_start for r in rounds]
            try:
                await before
            finally:
                del steps.in_flight[index]
                del steps.in_flight_prompts[index]
        state.ready.append(rounds)
