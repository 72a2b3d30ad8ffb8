"""The step calls: each piece of a step (generate and score, the fused sync step, train,
weight sync, checkpoint, evaluate) as the activity it calls, with the bookkeeping the
workflow keeps around them: the batches in flight and their prompts, and the rollout lock.

How each activity is called (time limits, heartbeats, retries) is phases.py; what a batch
is generated with and what a checkpoint keeps is scheduling.py. Deterministic: activities
are called by name with the dataclasses of `ratchet.types`.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow

from ratchet.types import (
    BatchRef,
    CheckpointInput,
    CheckpointOutput,
    EvalInput,
    EvalOutput,
    LoopPlan,
    RolloutInput,
    RunState,
    ScoredBatch,
    ScoreInput,
    ScoreOutput,
    StepInput,
    StepOutput,
    StepRecord,
    SyncInput,
    SyncOutput,
    TrainInput,
    TrainOutput,
)
from ratchet.workflows import scheduling as sched
from ratchet.workflows import search_attributes as sa
from ratchet.workflows.phases import PHASES, RETRY

from .scope import RunScope


class StepCalls:
    def __init__(self, scope: RunScope) -> None:
        self.scope = scope
        self.in_flight: dict[int, int] = {}  # batch index -> version generating it
        self.in_flight_prompts: dict[int, list[int]] = {}  # batch index -> prompt starts taken
        # The rollout engine runs one thing at a time: a generation, a weight sync or an
        # evaluation. The lock keeps the workflow's idea of its version exact.
        self.rollout_lock = asyncio.Lock()
        self.rollout_busy_seconds = 0.0  # generation seconds since the last recorded step
        self.checkpointed_step: int | None = None  # the step of the latest checkpoint taken or restored

    async def call(self, phase: str, arg, result_type):
        self.scope.phase = phase
        p = PHASES[phase]
        return await workflow.execute_activity(
            phase,
            arg,
            result_type=result_type,
            start_to_close_timeout=p.timeout,
            heartbeat_timeout=timedelta(seconds=self.scope.plan.heartbeat_timeout_s) if p.heartbeat else None,
            retry_policy=RETRY,
            # The UI's label for this call ("generate batch 12 with v11"); metadata only,
            # so histories recorded without it still replay.
            summary=sa.activity_summary(phase, arg, self.scope.next_step),
        )

    def _take_prompts(self, state: RunState, plan: LoopPlan, index: int) -> int:
        start = sched.next_prompt_start(state)
        if state.retry_prompts:
            state.retry_prompts.pop(0)
        else:
            state.next_prompt += plan.prompts_per_step
        self.in_flight_prompts[index].append(start)
        return start

    def _begin_batch(self, state: RunState, plan: LoopPlan) -> tuple[int, int]:
        """The next batch's index and the version that generates it, counted in flight."""
        index = state.next_batch
        state.next_batch += 1
        version = sched.generating_version(plan, state, index)
        self.in_flight[index] = version
        self.in_flight_prompts[index] = []
        return index, version

    def _end_batch(self, index: int) -> None:
        del self.in_flight[index]
        del self.in_flight_prompts[index]

    async def rollout(self, state: RunState, plan: LoopPlan, *, generated: asyncio.Event | None = None) -> list[ScoredBatch]:
        """Generate and score the next batch; with dynamic sampling, more rounds until enough
        groups carry signal (or the round budget is spent). `generated` is set once the
        rollout engine is free again: with one round, before the batch is scored."""
        index, version = self._begin_batch(state, plan)
        rounds: list[ScoredBatch] = []
        informative = 0
        try:
            for part in range(plan.sampling_rounds):
                async with self.rollout_lock:
                    batch: BatchRef = await self.call(
                        "generate",
                        RolloutInput(
                            run=state.run,
                            batch_index=index,
                            prompt_start=self._take_prompts(state, plan, index),
                            prompt_count=plan.prompts_per_step,
                            policy_version=version,
                            part=part,
                            exact_version=plan.deterministic,
                        ),
                        BatchRef,
                    )
                if generated is not None and plan.sampling_rounds == 1:
                    generated.set()
                self.rollout_busy_seconds += batch.generate_seconds
                scored: ScoreOutput = await self.call("score", ScoreInput(state.run, batch), ScoreOutput)
                rounds.append(ScoredBatch(batch, scored))
                informative += scored.informative_groups
                if informative >= plan.prompts_per_step:
                    break
        finally:
            self._end_batch(index)
            if generated is not None:
                generated.set()
        return rounds

    async def fused_step(
        self, state: RunState, plan: LoopPlan, *, record: StepRecord | None, prefetch: bool
    ) -> tuple[list[ScoredBatch], TrainOutput, SyncOutput]:
        """Sync mode's step as one `step` activity: generate, score, train and sync on the
        actors, the batch handed between them in memory; one round trip instead of four.
        `record`: the last step's metrics line, which this activity writes (however it
        ends); `prefetch`: the next step's prompts may be read ahead."""
        index, version = self._begin_batch(state, plan)
        try:
            rollout = RolloutInput(
                run=state.run,
                batch_index=index,
                prompt_start=self._take_prompts(state, plan, index),
                prompt_count=plan.prompts_per_step,
                policy_version=version,
                exact_version=plan.deterministic,
            )
            next_start = sched.next_prompt_start(state) if prefetch else None
            inp = StepInput(
                rollout, state.policy_version, kl_coef=state.kl_coef, live=dict(state.live.values), safe_lambda=state.safe_lambda,
                record=record, next_prompt_start=next_start,
            )  # fmt: skip
            async with self.rollout_lock:
                out: StepOutput = await self.call("step", inp, StepOutput)
        finally:
            self._end_batch(index)
        self.rollout_busy_seconds += out.batch.generate_seconds
        state.policy_version = out.trained.policy_version
        state.kl_coef = out.trained.kl_coef
        state.safe_lambda = out.trained.safe_lambda
        state.rollout_version = max(state.rollout_version, out.synced.policy_version)
        return [ScoredBatch(out.batch, out.score)], out.trained, out.synced

    async def train(self, state: RunState, rounds: list[ScoredBatch]) -> TrainOutput:
        first = rounds[0].batch
        trained: TrainOutput = await self.call(
            "train",
            TrainInput(
                state.run,
                first,
                state.policy_version,
                kl_coef=state.kl_coef,
                parts=len(rounds),
                live=dict(state.live.values),
                safe_lambda=state.safe_lambda,
            ),
            TrainOutput,
        )
        state.policy_version = trained.policy_version
        state.kl_coef = trained.kl_coef
        state.safe_lambda = trained.safe_lambda
        return trained

    async def sync(self, state: RunState) -> SyncOutput:
        if self.scope.plan.partial_rollout:
            # The rollout worker itself orders the sync against the generation in flight.
            return await self.sync_now(state)
        async with self.rollout_lock:
            return await self.sync_now(state)

    async def sync_now(self, state: RunState) -> SyncOutput:
        synced: SyncOutput = await self.call("sync_weights", SyncInput(state.run, state.policy_version), SyncOutput)
        state.rollout_version = max(state.rollout_version, synced.policy_version)
        return synced

    async def checkpoint(self, state: RunState) -> CheckpointOutput:
        """The trainer state now, with the run state a resume carries on from (batches still
        being generated are rolled out again: `scheduling.checkpoint_snapshot`)."""
        snapshot = sched.checkpoint_snapshot(state, self.in_flight, self.in_flight_prompts)
        saved: CheckpointOutput = await self.call(
            "checkpoint", CheckpointInput(state.run, state.next_step, state.policy_version, snapshot), CheckpointOutput
        )
        self.checkpointed_step = state.next_step
        return saved

    async def evaluate(self, state: RunState, step: int) -> None:
        # Evaluation loads the trainer's weights into the rollout engine if it serves older ones.
        async with self.rollout_lock:
            out: EvalOutput = await self.call("evaluate", EvalInput(state.run, step, state.policy_version), EvalOutput)
            state.rollout_version = state.policy_version
        state.record_eval(step, out.reward_mean)
