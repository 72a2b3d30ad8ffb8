"""The training workflow, mode `sync`: per step rollout, score, train, sync, in order.

The workflow is the controller with the global view (HybridFlow): it owns the run state
(step, policy version, prompt frontier) and tells workers what to do; the workers are
caches of that state. Everything here is deterministic (DESIGN.md, rule 8): no torch, no
Ray, no clocks; activities are called by name with dataclasses from `ratchet.types`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

from ratchet.types import (
    BatchRef,
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
# Short activities heartbeat every second while they wait on Ray (activities/ray_calls.py);
# a worker process that died is noticed after HEARTBEAT, not after the whole timeout.
HEARTBEAT = timedelta(seconds=30)


@dataclass
class Phase:
    """How one kind of activity is called: its timeout bounds a single attempt."""

    name: str
    timeout: timedelta
    heartbeat: bool = True


PHASES = {
    "prepare_run": Phase("prepare_run", timedelta(minutes=2), heartbeat=False),
    "warmup": Phase("warmup", timedelta(minutes=30)),
    "start_workers": Phase("start_workers", timedelta(minutes=10)),
    "generate": Phase("generate", timedelta(minutes=30)),
    "score": Phase("score", timedelta(minutes=30)),
    "train": Phase("train", timedelta(minutes=30)),
    "sync_weights": Phase("sync_weights", timedelta(minutes=10)),
    "evaluate": Phase("evaluate", timedelta(minutes=30)),
    "record_step": Phase("record_step", timedelta(minutes=1), heartbeat=False),
    "finish_run": Phase("finish_run", timedelta(minutes=10)),
}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


@workflow.defn(name="TrainingWorkflow")
class TrainingWorkflow:
    def __init__(self) -> None:
        self._state: RunState | None = None
        self._plan: LoopPlan | None = None
        self._run_id = ""
        self._phase = "starting"
        self._tokens_per_second: float | None = None

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
        )

    async def _call(self, phase: str, arg, result_type):
        self._phase = phase
        p = PHASES[phase]
        return await workflow.execute_activity(
            phase,
            arg,
            result_type=result_type,
            start_to_close_timeout=p.timeout,
            heartbeat_timeout=HEARTBEAT if p.heartbeat else None,
            retry_policy=RETRY,
        )

    @workflow.run
    async def run(self, inp: TrainingInput) -> RunSummary:
        self._run_id, self._plan = inp.run_id, inp.plan
        self._state = inp.resume if inp.resume is not None else await self._begin(inp)
        state, plan = self._state, self._plan

        while state.next_step < plan.steps:
            await self._step(state, plan)
            if workflow.info().is_continue_as_new_suggested() and state.next_step < plan.steps:
                self._phase = "continuing"
                workflow.continue_as_new(replace(inp, resume=state))

        if plan.evaluate and str(plan.steps) not in state.eval_rewards:
            await self._evaluate(state, plan.steps)
        done: FinishOutput = await self._call("finish_run", FinishInput(state.run, state.policy_version), FinishOutput)
        self._phase = "completed"
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
        )

    async def _begin(self, start: TrainingInput) -> RunState:
        prep: PrepareOutput = await self._call("prepare_run", PrepareInput(start.run_id, start.config), PrepareOutput)
        warm: WarmupOutput = await self._call("warmup", WarmupInput(prep.run), WarmupOutput)
        await self._call("start_workers", StartWorkersInput(prep.run, warm.policy_uri), StartWorkersOutput)
        state = RunState(
            run=prep.run,
            policy_uri=warm.policy_uri,
            kl_coef=start.plan.kl_coef,
            warmup_loss_first=warm.loss_first,
            warmup_loss_last=warm.loss_last,
        )
        self._state = state
        if start.plan.evaluate:
            await self._evaluate(state, 0)
        return state

    async def _evaluate(self, state: RunState, step: int) -> None:
        out: EvalOutput = await self._call("evaluate", EvalInput(state.run, step, state.policy_version), EvalOutput)
        state.eval_rewards[str(step)] = out.reward_mean

    async def _rollout(self, state: RunState, plan: LoopPlan, step: int) -> list[tuple[BatchRef, ScoreOutput]]:
        """Generate and score one round of prompts; with dynamic sampling, more rounds until
        enough groups carry signal (or the round budget is spent)."""
        rounds: list[tuple[BatchRef, ScoreOutput]] = []
        informative = 0
        for part in range(plan.sampling_rounds):
            batch: BatchRef = await self._call(
                "generate",
                RolloutInput(
                    run=state.run,
                    step=step,
                    prompt_start=state.next_prompt,
                    prompt_count=plan.prompts_per_step,
                    policy_version=state.policy_version,
                    part=part,
                ),
                BatchRef,
            )
            state.next_prompt += plan.prompts_per_step
            scored: ScoreOutput = await self._call("score", ScoreInput(state.run, batch), ScoreOutput)
            rounds.append((batch, scored))
            informative += scored.informative_groups
            if informative >= plan.prompts_per_step:
                break
        return rounds

    async def _step(self, state: RunState, plan: LoopPlan) -> None:
        step = state.next_step
        rounds = await self._rollout(state, plan, step)
        first = rounds[0][0]
        trained: TrainOutput = await self._call(
            "train", TrainInput(state.run, first, state.policy_version, kl_coef=state.kl_coef, parts=len(rounds)), TrainOutput
        )
        synced: SyncOutput = await self._call("sync_weights", SyncInput(state.run, trained.policy_version), SyncOutput)

        samples = sum(b.num_samples for b, _ in rounds)
        reward_mean = sum(s.reward_mean * b.num_samples for b, s in rounds) / samples
        gen_seconds = sum(b.generate_seconds for b, _ in rounds)
        state.policy_version = trained.policy_version
        state.kl_coef = trained.kl_coef
        state.rewards.append(reward_mean)
        state.next_step = step + 1
        self._tokens_per_second = sum(b.num_response_tokens for b, _ in rounds) / max(gen_seconds, 1e-9)
        metrics = {
            "reward_mean": reward_mean,
            "reward_std": rounds[0][1].reward_std,
            "response_length": sum(b.response_length_mean * b.num_samples for b, _ in rounds) / samples,
            "tokens_per_second": self._tokens_per_second,
            "policy_version": float(state.policy_version),
            "rollout_rounds": float(len(rounds)),
            "generate_seconds": gen_seconds,
            "score_seconds": sum(s.seconds for _, s in rounds),
            "train_seconds": trained.seconds,
            "sync_seconds": synced.seconds,
            "sync_megabytes": synced.megabytes,
            **{k: v for k, v in trained.metrics.items() if k not in ("response_length", "train_seconds")},
        }
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
