"""The training workflow: warm-up, then RL steps in one of three loop modes.

- `sync`: per step rollout, score, train, sync, in order (the on-policy baseline).
- `one_step_off`: batch n+1 is generated with the weights of step n while step n trains;
  the new weights are synced before the rollout after it starts.
- `fully_async`: a producer keeps rollouts running ahead of the trainer; a batch starts only
  if it will be at most `max_staleness` versions old when trained, the trainer takes ready
  batches oldest first, drops (and redoes) any that are staler, and weights sync every
  `sync_every` updates. With partial rollouts the sync does not wait for the generation in
  flight: the engine takes the new weights between two decode steps and carries on.

The workflow is the controller with the global view (HybridFlow): it owns the run state
(step, policy versions, prompt frontier, ready batches) and tells workers what to do; the
workers are caches of that state. Everything here is deterministic (DESIGN.md, rule 8):
no torch, no Ray, no clocks but `workflow.now()`; activities are called by name with
dataclasses from `ratchet.types`. `pause`, `resume` and `stop` take effect at a step
boundary in every mode.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

from ratchet.types import (
    BatchRef,
    CheckpointInput,
    CheckpointOutput,
    BatchStatus,
    EvalInput,
    EvalOutput,
    FinishInput,
    FinishOutput,
    LoopPlan,
    PrepareInput,
    PrepareOutput,
    Progress,
    RolloutInput,
    RunState,
    RunSummary,
    ScoredBatch,
    ScoreInput,
    ScoreOutput,
    StartWorkersInput,
    StartWorkersOutput,
    StepRecord,
    SyncInput,
    SyncOutput,
    TrainingInput,
    TrainInput,
    TrainOutput,
    WarmupInput,
    WarmupOutput,
)

# Transient failures (a worker restarting, storage hiccups) are retried with backoff; an
# error that retrying cannot fix (bad config, lost trainer state) fails the run at once.
RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=5,
    non_retryable_error_types=["ConfigError", "WorkerLost", "RewardLoadError"],
)
# Activities heartbeat every second while they wait on Ray (activities/ray_calls.py); a
# worker process that died is noticed after `loop.heartbeat_timeout_s`, not after the
# whole timeout, and its activity is retried on another worker.


@dataclass
class Phase:
    """How one kind of activity is called: its timeout bounds a single attempt."""

    timeout: timedelta
    heartbeat: bool = True


PHASES = {
    "prepare_run": Phase(timedelta(minutes=2), heartbeat=False),
    "warmup": Phase(timedelta(minutes=30)),
    "start_workers": Phase(timedelta(minutes=10)),
    "generate": Phase(timedelta(minutes=30)),
    "score": Phase(timedelta(minutes=30)),
    "train": Phase(timedelta(minutes=30)),
    "sync_weights": Phase(timedelta(minutes=10)),
    "evaluate": Phase(timedelta(minutes=30)),
    "checkpoint": Phase(timedelta(minutes=10)),
    "record_step": Phase(timedelta(minutes=1), heartbeat=False),
    "finish_run": Phase(timedelta(minutes=10)),
}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _samples(rounds: list[ScoredBatch]) -> int:
    return sum(r.batch.num_samples for r in rounds)


@workflow.defn(name="TrainingWorkflow")
class TrainingWorkflow:
    def __init__(self) -> None:
        self._state: RunState | None = None
        self._plan: LoopPlan | None = None
        self._run_id = ""
        self._phase = "starting"
        self._tokens_per_second: float | None = None
        self._paused = False
        self._stopping = False
        self._in_flight: dict[int, int] = {}  # batch index -> version generating it
        self._in_flight_prompts: dict[int, list[int]] = {}  # batch index -> prompt starts taken
        # The rollout engine runs one thing at a time: a generation, a weight sync or an
        # evaluation. The lock keeps the workflow's idea of its version exact.
        self._rollout_lock = asyncio.Lock()
        self._rollout_busy_seconds = 0.0  # generation seconds since the last recorded step
        self._stopping_producer = False  # fully_async: the trainer is done, stop producing
        self._training = False  # fully_async: an update is running

    # -- signals and queries -------------------------------------------------------------

    @workflow.signal
    def pause(self) -> None:
        self._paused = True

    @workflow.signal
    def resume(self) -> None:
        self._paused = False

    @workflow.signal
    def stop(self) -> None:
        """Finish at the next step boundary: export the policy and complete."""
        self._stopping = True

    @workflow.query
    def progress(self) -> Progress:
        s = self._state
        return Progress(
            run_id=self._run_id,
            phase=self._phase,
            step=s.next_step if s else 0,
            total_steps=self._plan.steps if self._plan else 0,
            policy_version=s.policy_version if s else 0,
            reward_mean=s.rewards[-1] if s and s.rewards else None,
            tokens_per_second=self._tokens_per_second,
            eval_rewards=dict(s.eval_rewards) if s else {},
            paused=self._paused,
            stopping=self._stopping,
        )

    @workflow.query
    def batches(self) -> list[BatchStatus]:
        """Batches in flight (being generated) and ready (scored, waiting for the trainer)."""
        out = [BatchStatus(index=i, state="in_flight", policy_version=v) for i, v in sorted(self._in_flight.items())]
        for rounds in self._state.ready if self._state else []:
            b = rounds[0].batch
            out.append(BatchStatus(index=b.step, state="ready", policy_version=b.policy_version, num_samples=_samples(rounds)))
        return out

    # -- the run -------------------------------------------------------------------------

    @workflow.run
    async def run(self, inp: TrainingInput) -> RunSummary:
        self._run_id, self._plan = inp.run_id, inp.plan
        if inp.resume is None:
            self._state = await self._begin(inp)
        elif inp.restore:
            self._state = await self._restore(inp)
        else:
            self._state = inp.resume
        state, plan = self._state, self._plan
        loop = {"sync": self._sync_loop, "one_step_off": self._one_step_off_loop, "fully_async": self._fully_async_loop}[plan.mode]
        if await loop(state, plan):
            self._phase = "continuing"
            workflow.continue_as_new(replace(inp, resume=state))
        if plan.evaluate and str(state.next_step) not in state.eval_rewards:
            await self._evaluate(state, state.next_step)
        done: FinishOutput = await self._call("finish_run", FinishInput(state.run, state.policy_version), FinishOutput)
        self._phase = "stopped" if self._stopping else "completed"
        return RunSummary(
            run_id=state.run.run_id,
            run_uri=state.run.run_uri,
            steps=state.next_step,
            policy_version=state.policy_version,
            final_policy_uri=done.final_policy_uri,
            reward_first10=_mean(state.rewards[:10]),
            reward_last10=_mean(state.rewards[-10:]),
            eval_rewards=state.eval_rewards,
            warmup_loss_first=state.warmup_loss_first,
            warmup_loss_last=state.warmup_loss_last,
            stopped=self._stopping and state.next_step < plan.steps,
            dropped_samples=state.dropped_samples,
        )

    async def _begin(self, start: TrainingInput) -> RunState:
        prep: PrepareOutput = await self._call("prepare_run", PrepareInput(start.run_id, start.config), PrepareOutput)
        warm: WarmupOutput = await self._call("warmup", WarmupInput(prep.run), WarmupOutput)
        await self._call("start_workers", StartWorkersInput(prep.run, warm.policy_uri), StartWorkersOutput)
        state = RunState(
            run=prep.run,
            kl_coef=start.plan.kl_coef,
            warmup_loss_first=warm.loss_first,
            warmup_loss_last=warm.loss_last,
        )
        self._state = state
        if start.plan.evaluate:
            await self._evaluate(state, 0)
        return state

    async def _restore(self, start: TrainingInput) -> RunState:
        """A resume from a checkpoint's run state: store the (possibly changed) config and
        rebuild the workers at the checkpoint's version."""
        state = start.resume
        prep: PrepareOutput = await self._call("prepare_run", PrepareInput(start.run_id, start.config), PrepareOutput)
        state.run = prep.run
        await self._call("start_workers", StartWorkersInput(prep.run, "", restore_version=state.policy_version), StartWorkersOutput)
        self._state = state
        await self._sync_now(state)  # the new rollout worker serves the checkpoint's policy
        return state

    # -- the three loops; each returns True when the run should continue as new -----------

    async def _sync_loop(self, state: RunState, plan: LoopPlan) -> bool:
        while state.next_step < plan.steps and await self._boundary():
            t0 = workflow.now()
            rounds = await self._rollout(state, plan)
            trained = await self._train(state, rounds)
            synced = await self._sync(state)
            await self._record(state, plan, rounds, trained, synced, t0, trainer_wait=0.0)
            if self._continue_as_new_suggested(state, plan):
                return True
        return False

    async def _one_step_off_loop(self, state: RunState, plan: LoopPlan) -> bool:
        while state.next_step < plan.steps and await self._boundary():
            t0 = workflow.now()
            wait = 0.0
            if not state.ready:  # the first step (or a stop/continue left nothing ready)
                state.ready.append(await self._rollout(state, plan))
                wait = (workflow.now() - t0).total_seconds()
            rounds = state.ready.pop(0)
            # Batch n+1 is generated with the weights the rollout holds now (step n's) while
            # step n trains; the sync after both brings the rollout to the new version.
            more = state.next_step + 1 < plan.steps and not self._stopping
            training = asyncio.ensure_future(self._train(state, rounds))
            generating = asyncio.ensure_future(self._rollout(state, plan)) if more else None
            trained = await training
            if generating is not None:
                state.ready.append(await generating)
            synced = await self._sync(state)
            await self._record(state, plan, rounds, trained, synced, t0, trainer_wait=wait)
            if self._continue_as_new_suggested(state, plan):
                return True
        return False

    async def _fully_async_loop(self, state: RunState, plan: LoopPlan) -> bool:
        producer = asyncio.ensure_future(self._produce(state, plan))
        updates_since_sync = 0
        can = False
        # With partial rollouts a sync runs while the next update does: the rollout worker
        # orders it against its generation, and it pushes whatever version the trainer holds.
        syncing: asyncio.Future | None = None
        try:
            while state.next_step < plan.steps and await self._boundary():
                t0 = workflow.now()
                await workflow.wait_condition(lambda: bool(state.ready) or producer.done())
                if not state.ready:
                    break  # the producer ended (stop signal)
                wait = (workflow.now() - t0).total_seconds()
                rounds = state.ready.pop(0)
                staleness = state.policy_version - rounds[0].batch.policy_version
                if staleness > plan.max_staleness:
                    # Never trained on silently: counted, and its prompts are rolled out again.
                    state.dropped_samples += _samples(rounds)
                    state.retry_prompts.append(rounds[0].batch.prompt_start)
                    continue
                self._training = True
                trained = await self._train(state, rounds)
                self._training = False
                updates_since_sync += 1
                synced = None
                if updates_since_sync >= plan.sync_every:
                    if plan.partial_rollout:
                        synced = await syncing if syncing is not None else None  # one in flight at a time
                        syncing = asyncio.ensure_future(self._sync(state))
                    else:
                        synced = await self._sync(state)
                    updates_since_sync = 0
                await self._record(state, plan, rounds, trained, synced, t0, trainer_wait=wait, staleness=staleness)
                if self._continue_as_new_suggested(state, plan):
                    can = True
                    break
        finally:
            self._stopping_producer = True
            if syncing is not None:
                await syncing
        # Batches the producer finishes stay in state.ready (carried on continue-as-new). The
        # final evaluation loads the latest weights itself; the export reads the trainer.
        await producer
        return can

    async def _produce(self, state: RunState, plan: LoopPlan) -> None:
        """fully_async: keep rollouts going while staleness and the queue allow."""

        def may_start() -> bool:
            # Every batch ahead of a new one (training, ready, in flight) adds a version first.
            ahead = len(state.ready) + len(self._in_flight) + int(self._training)
            # The new batch is trained after everything ahead of it: its staleness then.
            staleness_then = state.policy_version + ahead - state.rollout_version
            total_batches = state.next_step + ahead
            return ahead < plan.queue_limit and staleness_then <= plan.max_staleness and total_batches < plan.steps

        # A batch is scored while the next one is generated: the reward worker does not
        # need the rollout engine. Batches still enter `ready` in order.
        previous: asyncio.Future | None = None
        try:
            while True:
                await workflow.wait_condition(lambda: self._stopping_producer or self._stopping or (not self._paused and may_start()))
                if self._stopping_producer or self._stopping:
                    return
                generated = asyncio.Event()
                previous = asyncio.ensure_future(self._produce_one(state, plan, generated, previous))
                await generated.wait()
                if previous.done():
                    previous.result()  # a failed rollout fails the run now, not at the end
        finally:
            if previous is not None:
                await previous

    async def _produce_one(self, state: RunState, plan: LoopPlan, generated: asyncio.Event, before) -> None:
        rounds = await self._rollout(state, plan, generated=generated)
        if before is not None:
            await before
        state.ready.append(rounds)

    # -- pieces of a step ----------------------------------------------------------------

    async def _boundary(self) -> bool:
        """Wait while paused; False once a stop was asked for."""
        if self._paused and not self._stopping:
            self._phase = "paused"
            await workflow.wait_condition(lambda: not self._paused or self._stopping)
        return not self._stopping

    def _continue_as_new_suggested(self, state: RunState, plan: LoopPlan) -> bool:
        if state.next_step >= plan.steps:
            return False
        every = plan.continue_as_new_every
        return workflow.info().is_continue_as_new_suggested() or bool(every and state.next_step % every == 0)

    async def _call(self, phase: str, arg, result_type):
        self._phase = phase
        p = PHASES[phase]
        return await workflow.execute_activity(
            phase,
            arg,
            result_type=result_type,
            start_to_close_timeout=p.timeout,
            heartbeat_timeout=timedelta(seconds=self._plan.heartbeat_timeout_s) if p.heartbeat else None,
            retry_policy=RETRY,
        )

    def _take_prompts(self, state: RunState, plan: LoopPlan, index: int) -> int:
        if state.retry_prompts:
            start = state.retry_prompts.pop(0)
        else:
            start = state.next_prompt
            state.next_prompt += plan.prompts_per_step
        self._in_flight_prompts[index].append(start)
        return start

    async def _rollout(self, state: RunState, plan: LoopPlan, *, generated: asyncio.Event | None = None) -> list[ScoredBatch]:
        """Generate and score the next batch; with dynamic sampling, more rounds until enough
        groups carry signal (or the round budget is spent). `generated` is set once the
        rollout engine is free again: with one round, before the batch is scored."""
        index = state.next_batch
        state.next_batch += 1
        rounds: list[ScoredBatch] = []
        informative = 0
        self._in_flight[index] = state.rollout_version
        self._in_flight_prompts[index] = []
        try:
            for part in range(plan.sampling_rounds):
                async with self._rollout_lock:
                    batch: BatchRef = await self._call(
                        "generate",
                        RolloutInput(
                            run=state.run,
                            step=index,
                            prompt_start=self._take_prompts(state, plan, index),
                            prompt_count=plan.prompts_per_step,
                            policy_version=state.rollout_version,
                            part=part,
                        ),
                        BatchRef,
                    )
                if generated is not None and plan.sampling_rounds == 1:
                    generated.set()
                self._rollout_busy_seconds += batch.generate_seconds
                scored: ScoreOutput = await self._call("score", ScoreInput(state.run, batch), ScoreOutput)
                rounds.append(ScoredBatch(batch, scored))
                informative += scored.informative_groups
                if informative >= plan.prompts_per_step:
                    break
        finally:
            del self._in_flight[index]
            del self._in_flight_prompts[index]
            if generated is not None:
                generated.set()
        return rounds

    async def _train(self, state: RunState, rounds: list[ScoredBatch]) -> TrainOutput:
        first = rounds[0].batch
        trained: TrainOutput = await self._call(
            "train", TrainInput(state.run, first, state.policy_version, kl_coef=state.kl_coef, parts=len(rounds)), TrainOutput
        )
        state.policy_version = trained.policy_version
        state.kl_coef = trained.kl_coef
        return trained

    async def _sync(self, state: RunState) -> SyncOutput:
        if self._plan.partial_rollout:
            # The rollout worker itself orders the sync against the generation in flight.
            return await self._sync_now(state)
        async with self._rollout_lock:
            return await self._sync_now(state)

    async def _sync_now(self, state: RunState) -> SyncOutput:
        synced: SyncOutput = await self._call("sync_weights", SyncInput(state.run, state.policy_version), SyncOutput)
        state.rollout_version = max(state.rollout_version, synced.policy_version)
        return synced

    async def _checkpoint(self, state: RunState) -> CheckpointOutput:
        """The trainer state now, with the run state a resume carries on from. Batches still
        being generated are not in it: their prompts are queued to be rolled out again."""
        in_flight = [p for starts in self._in_flight_prompts.values() for p in starts]
        snapshot = replace(state, retry_prompts=[*state.retry_prompts, *in_flight], ready=list(state.ready))
        return await self._call(
            "checkpoint", CheckpointInput(state.run, state.next_step, state.policy_version, snapshot), CheckpointOutput
        )

    async def _evaluate(self, state: RunState, step: int) -> None:
        # Evaluation loads the trainer's weights into the rollout engine if it serves older ones.
        async with self._rollout_lock:
            out: EvalOutput = await self._call("evaluate", EvalInput(state.run, step, state.policy_version), EvalOutput)
            state.rollout_version = state.policy_version
        state.eval_rewards[str(step)] = out.reward_mean

    async def _record(
        self,
        state: RunState,
        plan: LoopPlan,
        rounds: list[ScoredBatch],
        trained: TrainOutput,
        synced: SyncOutput | None,
        started,
        *,
        trainer_wait: float,
        staleness: int | None = None,
    ) -> None:
        step = state.next_step
        samples = _samples(rounds)
        reward_mean = sum(r.score.reward_mean * r.batch.num_samples for r in rounds) / samples
        gen_seconds = sum(r.batch.generate_seconds for r in rounds)
        wall = max((workflow.now() - started).total_seconds(), 1e-9)
        state.rewards.append(reward_mean)
        state.next_step = step + 1
        self._tokens_per_second = sum(r.batch.num_response_tokens for r in rounds) / max(gen_seconds, 1e-9)
        batch_version = rounds[0].batch.policy_version
        metrics = {
            "reward_mean": reward_mean,
            "reward_std": rounds[0].score.reward_std,
            "response_length": sum(r.batch.response_length_mean * r.batch.num_samples for r in rounds) / samples,
            "tokens_per_second": self._tokens_per_second,
            "policy_version": float(state.policy_version),
            "batch_index": float(rounds[0].batch.step),
            "batch_policy_version": float(batch_version),
            # How many versions behind the trained policy the samples were (0 in sync mode).
            "staleness": float(staleness if staleness is not None else trained.policy_version - 1 - batch_version),
            "rollout_rounds": float(len(rounds)),
            "generate_seconds": gen_seconds,
            "score_seconds": sum(r.score.seconds for r in rounds),
            "train_seconds": trained.seconds,
            "sync_seconds": synced.seconds if synced else 0.0,
            "sync_megabytes": synced.megabytes if synced else 0.0,
            "step_seconds": wall,
            "trainer_idle_fraction": min(trainer_wait / wall, 1.0),
            "rollout_idle_fraction": max(0.0, 1.0 - self._rollout_busy_seconds / wall),
            "queue_depth": float(len(state.ready)),
            "dropped_samples": float(state.dropped_samples),
            **{k: v for k, v in trained.metrics.items() if k not in ("response_length", "train_seconds")},
        }
        self._rollout_busy_seconds = 0.0
        if plan.checkpoint_every and state.next_step % plan.checkpoint_every == 0:
            saved = await self._checkpoint(state)
            metrics["checkpoint_stall_seconds"] = saved.stall_seconds + saved.waited_seconds
        if plan.evaluate and plan.eval_every and state.next_step % plan.eval_every == 0:
            await self._evaluate(state, state.next_step)
            metrics["eval_reward"] = state.eval_rewards[str(state.next_step)]
        # A local activity: a few milliseconds of file I/O need no task-queue round trip.
        self._phase = "record_step"
        await workflow.execute_local_activity(
            "record_step",
            StepRecord(state.run, step, metrics),
            start_to_close_timeout=PHASES["record_step"].timeout,
            retry_policy=RETRY,
        )
