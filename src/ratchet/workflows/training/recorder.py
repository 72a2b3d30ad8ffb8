"""The metrics recorder: counts a finished step into the run state and writes its metrics
line (in the background, by the next step's activity, or at once when a checkpoint or an
evaluation follows), and shows the run in the Temporal UI."""

from __future__ import annotations

import asyncio

from temporalio import workflow

from ratchet.types import LoopPlan, RunState, ScoredBatch, StepRecord, SyncOutput, TrainOutput
from ratchet.workflows import live
from ratchet.workflows import scheduling as sched
from ratchet.workflows import search_attributes as sa
from ratchet.workflows.phases import PHASES, RETRY

from .control import RunControl
from .patches import RECORD_IN_NEXT_STEP, SEARCH_ATTRIBUTES
from .scope import RunScope
from .steps import StepCalls


class StepRecorder:
    def __init__(
        self, scope: RunScope, control: RunControl, steps: StepCalls, live_settings: live.LiveSettings, *, search_attributes: bool
    ):
        self.scope, self.control, self.steps, self.live = scope, control, steps, live_settings
        self.search_attributes = search_attributes  # the namespace has them: upsert (TrainingInput.search_attributes)
        self.tokens_per_second: float | None = None
        self._recording: asyncio.Future | None = None  # the latest step's metrics line, being written
        self._unwritten: StepRecord | None = None  # sync mode: the latest line, for the next step to write

    def take_unwritten(self) -> StepRecord | None:
        """The line left for the next step's activity to write (it writes it however it ends)."""
        record, self._unwritten = self._unwritten, None
        return record

    @property
    def has_unwritten(self) -> bool:
        return self._unwritten is not None

    async def record(
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
        next_step_writes: bool = False,
    ) -> None:
        """Count the step and write its metrics line: in the background (the next step starts
        meanwhile), by the next step's activity (`next_step_writes`: sync mode's fused step),
        or at once when a checkpoint or an evaluation follows. `written` writes whatever is
        still unwritten."""
        step = state.next_step
        state.record_reward(sched.reward_mean(rounds))
        state.next_step = step + 1
        self.live.step_running = False
        self.tokens_per_second = sched.tokens_per_second(rounds)
        metrics = sched.step_metrics(
            state,
            rounds,
            trained,
            synced,
            wall_seconds=(workflow.now() - started).total_seconds(),
            trainer_wait=trainer_wait,
            rollout_busy_seconds=self.steps.rollout_busy_seconds,
            staleness=staleness,
        )
        self.steps.rollout_busy_seconds = 0.0
        metrics.update(live.step_metrics(state, step))  # the values set live, and `live_changed`
        checkpoint_due = sched.checkpoint_due(plan, state.next_step)
        eval_due = sched.eval_due(plan, state.next_step)
        if not (checkpoint_due or eval_due):
            record = StepRecord(state.run, step, metrics)
            if (
                next_step_writes
                and state.next_step < plan.steps
                and not self.control.stopping
                and workflow.patched(RECORD_IN_NEXT_STEP.name)
            ):
                self._unwritten = record
            else:
                # Nothing here needs the trainer to wait: the metrics line is written while the
                # next step starts (in step order), which keeps a workflow task off its path.
                self._recording = asyncio.ensure_future(self._write(record, self._recording))
            self.show()
            return
        await self.written()
        if checkpoint_due:
            saved = await self.steps.checkpoint(state)
            metrics["checkpoint_stall_seconds"] = saved.stall_seconds + saved.waited_seconds
        if eval_due:
            await self.steps.evaluate(state, state.next_step)
            metrics["eval_reward"] = state.eval_rewards[str(state.next_step)]
        await self._write(StepRecord(state.run, step, metrics), None)
        self.show()

    def show(self, status: str | None = None) -> None:
        """The run as the Temporal UI shows it: the current details (step, reward, policy
        version) always; the search attributes (step, rewards, `status` when given) when the
        namespace has them. Called once per step and at pause, resume and the end, never per
        activity: each upsert is an event in the history."""
        s, plan = self.scope.state, self.scope.plan
        if s is None or plan is None:
            return
        evals = s.eval_rewards
        eval_reward = evals[max(evals, key=int)] if evals else None
        label = status or ("paused" if self.control.held_at_boundary else sa.Status.RUNNING)
        workflow.set_current_details(
            sa.current_details(
                phase=label,
                step=s.next_step,
                total_steps=plan.steps,
                policy_version=s.policy_version,
                reward=s.latest_reward,
                eval_reward=eval_reward,
            )  # fmt: skip
        )
        if self.search_attributes and workflow.patched(SEARCH_ATTRIBUTES.name):
            workflow.upsert_search_attributes(
                sa.progress_updates(step=s.next_step, reward=s.latest_reward, eval_reward=eval_reward, status=status)
            )

    async def _write(self, record: StepRecord, before: asyncio.Future | None) -> None:
        if before is not None:
            await before
        # A local activity: a few milliseconds of file I/O need no task-queue round trip.
        await workflow.execute_local_activity(
            "record_step", record, start_to_close_timeout=PHASES["record_step"].timeout, retry_policy=RETRY,
            summary=sa.activity_summary("record_step", record, record.step),
        )  # fmt: skip

    async def written(self) -> None:
        """Wait for the metrics lines still being written, and write the one left for a next
        step (before a checkpoint, an evaluation, a pause, continue-as-new or the end of the
        run)."""
        if self._recording is not None:
            await self._recording
            self._recording = None
        if self._unwritten is not None:
            record, self._unwritten = self._unwritten, None
            await self._write(record, None)
