"""The training workflow's shell: its signals, queries and update, and the run from start
(prepare, the admission queue, warm-up, workers; or a restore) through the loop mode's
steps to continue-as-new or the end (evaluate, export, the summary).

The workflow is the controller with the global view (HybridFlow): it owns the run state
(step, policy versions, prompt frontier, ready batches) and tells workers what to do; the
workers are caches of that state. Everything in this package is deterministic
(docs/design.md, rule 8): no torch, no Ray, no clocks but `workflow.now()`; activities are
called by name with dataclasses from `ratchet.types`. `pause`, `resume`, `stop`, `drain`
(move off a node about to go) and the `set_params` update (live hyper-parameters:
workflows/live.py) take effect at a step boundary in every mode, and none is lost to a
continue-as-new: a stop received in the step that continues as new ends the run there, a
pause or a drain travels in `TrainingInput.carried`, live changes and a sweep's rung
verdicts in the run state.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, FailureError

from ratchet.admission_types import AdmitInput, AdmitOutput
from ratchet.catalog.loop_modes import LOOP_MODES
from ratchet.types import (
    BatchStatus,
    CarriedCommands,
    FinishInput,
    FinishOutput,
    PrepareInput,
    PrepareOutput,
    Progress,
    ReleaseInput,
    ReleaseOutput,
    RunCommand,
    RunRef,
    RunState,
    RunSummary,
    StartWorkersInput,
    StartWorkersOutput,
    TrainingInput,
    WarmupInput,
    WarmupOutput,
)
from ratchet.workflows import commands, live
from ratchet.workflows import scheduling as sched
from ratchet.workflows import search_attributes as sa
from ratchet.workflows.phases import RETRY

from .control import RunControl
from .parts import RunParts
from .patches import ADMISSION_QUEUE, CHECKPOINT_ON_STOP, STOP_BEFORE_CONTINUE_AS_NEW
from .recorder import StepRecorder
from .scope import RunScope
from .steps import StepCalls

# One `admit_run` attempt answers within 4 minutes (a change of place, or still queued).
ADMIT_TIMEOUT = timedelta(minutes=10)
# Every loop mode the catalog names, imported with the workflow: imported during a run
# instead, each module would be imported again in every run's sandbox (Temporal warns).
LOOPS = {name: mode.loop() for name, mode in LOOP_MODES.objects()}


@workflow.defn(name="TrainingWorkflow")
class TrainingWorkflow:
    @workflow.init
    def __init__(self, inp: TrainingInput) -> None:
        self._scope = RunScope(inp.run_id, inp.plan)
        self._control = RunControl(inp.carried, inp.hold_at_steps)
        self._live = live.LiveSettings()  # hyper-parameters set while the run trains (set_params)
        steps = StepCalls(self._scope)
        recorder = StepRecorder(self._scope, self._control, steps, self._live, search_attributes=inp.search_attributes)
        self._parts = RunParts(self._scope, self._control, steps, recorder, self._live)
        self._left_queue = False  # stopped while it waited in the admission queue: nothing was built
        # What the run does before its first step, in words ("warm-up (10 steps)", "starting
        # workers", "restoring from step-00000029"); the progress query shows it as the phase.
        self._startup = ""

    # -- signals and queries -------------------------------------------------------------

    # pause, resume and stop act only on a RunCommand for this run (workflows/commands.py):
    # without arguments they would carry no payload the key authenticates.

    @workflow.signal
    def pause(self, command: RunCommand | None = None) -> None:
        if commands.accepted("pause", command):
            self._control.paused = True

    @workflow.signal
    def resume(self, command: RunCommand | None = None) -> None:
        if commands.accepted("resume", command):
            self._control.paused = False

    @workflow.signal
    def pass_rung(self, step: int) -> None:
        """The sweep's verdict on a trial at its rung `step`: go on (a stop is `stop`)."""
        self._control.pass_rung(step, self._scope.state)

    @workflow.signal
    def stop(self, command: RunCommand | None = None) -> None:
        """Finish at the next step boundary: export the policy and complete."""
        if commands.accepted("stop", command):
            self._control.stopping = True

    @workflow.signal
    def drain(self, node_id: str) -> None:
        """Ray node `node_id` is about to go (a spot reclaim, a Kubernetes drain): at the next
        step boundary the run checkpoints and moves its actors off it, so the planned loss
        replays nothing. `ratchet drain NODE` sends it to every run with actors there."""
        self._control.drain(node_id)

    @workflow.update
    def set_params(self, values: dict[str, Any]) -> live.LiveChange:
        """Change hyper-parameters of the running run from the next step boundary (keys and
        why: src/ratchet/config/live_keys.py). The update itself is the change's record in the
        history; it answers with the step the values apply from."""
        changes = self._live.check(self._scope.state, values, closing=None)
        return self._live.accept(self._scope.run_id, self._scope.state, changes)

    @set_params.validator
    def _check_params(self, values: dict[str, Any]) -> None:
        """Refuse, before it enters the history, a key that cannot change live, a value its
        config field refuses, or a change to a run that has no step left."""
        s, plan = self._scope.state, self._scope.plan
        closing = None
        if self._control.stopping:
            closing = "a stop was asked for; it ends at the next step boundary"
        elif self._scope.phase in ("finish_run", "completed", "stopped", "continuing") or (s and plan and s.next_step >= plan.steps):
            closing = "it has no step left to train (it is finishing)"
        self._live.check(s, values, closing=closing)

    @workflow.query
    def progress(self) -> Progress:
        s, control = self._scope.state, self._control
        return Progress(
            run_id=self._scope.run_id,
            phase="paused" if control.held_at_boundary else control.rung_phase() or self._startup or self._scope.phase,
            step=s.next_step if s else 0,
            total_steps=self._scope.plan.steps,
            policy_version=s.policy_version if s else 0,
            reward_mean=s.latest_reward if s else None,
            tokens_per_second=self._parts.recorder.tokens_per_second,
            eval_rewards=dict(s.eval_rewards) if s else {},
            paused=control.paused,
            stopping=control.stopping,
            activity=self._scope.phase,
        )

    @workflow.query
    def batches(self) -> list[BatchStatus]:
        """Batches in flight (being generated) and ready (scored, waiting for the trainer)."""
        in_flight = self._parts.steps.in_flight
        out = [BatchStatus(index=i, state="in_flight", policy_version=v) for i, v in sorted(in_flight.items())]
        for rounds in self._scope.state.ready if self._scope.state else []:
            b = rounds[0].batch
            out.append(BatchStatus(index=b.index, state="ready", policy_version=b.policy_version, num_samples=sched.num_samples(rounds)))
        return out

    # -- the run -------------------------------------------------------------------------

    @workflow.run
    async def run(self, inp: TrainingInput) -> RunSummary:
        self._live.config = inp.config
        try:
            return await self._run(inp)
        except workflow.NondeterminismError:
            # Workflow code that no longer matches the run's history (a deploy during the
            # run): the task is retried and the run carries on once matching code is back,
            # so it keeps its actors and is not failed. Temporal shows the task failure.
            raise
        except (Exception, asyncio.CancelledError) as exc:
            # Every way out but completion and continue-as-new (whose actors carry over,
            # ContinueAsNewError is not an Exception): the actors are detached and would
            # otherwise hold the run's CPUs forever. A cancelled workflow may still run
            # activities, so this runs on cancellation too.
            phase = self._scope.phase
            self._parts.recorder.show(sa.Status.CANCELLED if isinstance(exc, asyncio.CancelledError) else sa.Status.FAILED)
            await self._release_actors(exc)
            if isinstance(exc, (asyncio.CancelledError, FailureError)):
                raise  # an activity's failure (its cause named), or the cancellation
            # Any other exception is a bug in this code (or an input the submit checks let
            # through). Left alone it would fail the workflow *task*, which Temporal retries
            # forever while the run shows RUNNING; an ApplicationError fails the run instead.
            raise ApplicationError(
                f"the training workflow failed in phase {phase!r}: {type(exc).__name__}: {exc}. This is a bug in "
                "ratchet, or a config value the submit checks let through; the run's actors were released",
                type="WorkflowBug",
                non_retryable=True,
            ) from exc

    async def _run(self, inp: TrainingInput) -> RunSummary:
        scope, control, steps, recorder = self._scope, self._control, self._parts.steps, self._parts.recorder
        if inp.resume is None:
            scope.state = await self._begin(inp)
        elif inp.restore:
            # From the first query on, the progress shows the step and version being restored.
            scope.state = inp.resume
            self._startup = f"restoring from {inp.restore_from or f'step {inp.resume.next_step}'}"
            scope.state = await self._restore(inp)
        else:
            scope.state = inp.resume
        state, plan = scope.state, scope.plan
        state.rung_passed = max(state.rung_passed, control.rung_passed)
        if self._left_queue:
            return await self._stopped_in_queue(state)
        self._startup = ""
        loop = LOOPS[LOOP_MODES.check(plan.mode)]
        can = await loop(self._parts, state, plan)
        await recorder.written()
        if self._stop_needs_checkpoint(state) and workflow.patched(CHECKPOINT_ON_STOP.name):
            await steps.checkpoint(state)
        if can and control.stopping and workflow.patched(STOP_BEFORE_CONTINUE_AS_NEW.name):
            can = False  # stopped during the step that asked for continue-as-new: it ends here
        if can:
            scope.phase = "continuing"
            self._live.apply(state)  # a change not yet applied travels in the state
            # A pause or a drain not yet acted on goes to the next run, which holds (or moves
            # off the nodes) at its first step boundary; left behind, the run would train on.
            carried = CarriedCommands(paused=control.paused, draining=list(control.draining))
            # The workers and the version floor carry over as they are: the next run only
            # takes the state (restore=False), it does not rebuild from a checkpoint again.
            workflow.continue_as_new(replace(inp, resume=state, restore=False, carried=carried))
        if plan.evaluate and str(state.next_step) not in state.eval_rewards:
            await steps.evaluate(state, state.next_step)
        done: FinishOutput = await steps.call("finish_run", FinishInput(state.run, state.policy_version), FinishOutput)
        scope.phase = "stopped" if control.stopping else "completed"
        recorder.show(sa.Status.STOPPED if control.stopping else sa.Status.COMPLETED)
        return _summary(
            state,
            done.final_policy_uri,
            stopped=control.stopping and state.next_step < plan.steps,
            unsafe_tools=sa.unsafe_tools(inp.config),
        )

    def _stop_needs_checkpoint(self, state: RunState) -> bool:
        """A run stopped between two checkpoints (say at step 29 of every 10) checkpoints that
        step before it exports and completes: a resume then goes on from 29, not from 20.
        Not when checkpoints are off, nothing was trained, or the step has its checkpoint."""
        plan = self._scope.plan
        return (
            self._control.stopping
            and plan.checkpoint_every > 0
            and 0 < state.next_step < plan.steps
            and not sched.checkpoint_due(plan, state.next_step)
            and self._parts.steps.checkpointed_step != state.next_step
        )

    async def _release_actors(self, cause: BaseException) -> None:
        """Kill the run's actors; a failure here is logged, the run's own error is the one raised."""
        try:
            reason = "cancelled" if isinstance(cause, asyncio.CancelledError) else "failed"
            await self._parts.steps.call("release_run", ReleaseInput(self._scope.run_id, reason), ReleaseOutput)
        except Exception:
            workflow.logger.warning("run %s: releasing its actors after %r failed", self._scope.run_id, cause, exc_info=True)

    async def _admitted(self, run: RunRef) -> bool:
        """Wait in the cluster's admission queue until the run is granted every CPU and GPU
        it needs at once (src/ratchet/workers/actors/admission.py); meanwhile the progress
        shows its place ("queued: waiting for 2 CPUs; 1 run ahead"). Each `admit_run`
        attempt answers when the place changes. False when a stop comes first: the run
        leaves the queue (the attempt is cancelled, which gives up its place) having built
        nothing."""
        before, status, queued_at = self._startup, "", 0.0
        control = self._control
        while not control.stopping:
            self._scope.phase = "admit_run"
            asking = asyncio.ensure_future(
                workflow.execute_activity(
                    "admit_run",
                    AdmitInput(run, status, queued_at),
                    result_type=AdmitOutput,
                    start_to_close_timeout=ADMIT_TIMEOUT,
                    heartbeat_timeout=timedelta(seconds=self._scope.plan.heartbeat_timeout_s),
                    retry_policy=RETRY,
                    # A stop waits until the attempt has left the queue.
                    cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
                    summary=f"wait in the admission queue{': ' + status if status else ''}",
                )
            )
            try:
                await workflow.wait_condition(lambda: asking.done() or control.stopping)
            except asyncio.CancelledError:
                asking.cancel()  # the run is cancelled: release_run follows
                raise
            if control.stopping:
                if not asking.done():
                    asking.cancel()
                    try:
                        await asking
                    except (asyncio.CancelledError, ActivityError):
                        pass  # cancelled, as asked
                break  # an admission in the same moment is released with the run
            out: AdmitOutput = asking.result()
            if out.admitted:
                self._startup = before
                return True
            status, queued_at = out.status, out.queued_at
            self._startup = f"queued: {status}"
        self._left_queue = True
        return False

    async def _stopped_in_queue(self, state: RunState) -> RunSummary:
        """A stop while the run waited for the cluster: it built nothing and exports
        nothing; its place in the queue (or a grant given in the same moment) is released."""
        await self._parts.steps.call("release_run", ReleaseInput(self._scope.run_id, "stopped"), ReleaseOutput)
        self._startup = ""
        self._scope.phase = "stopped"
        self._parts.recorder.show(sa.Status.STOPPED)
        return _summary(state, "", stopped=True)

    async def _begin(self, start: TrainingInput) -> RunState:
        steps = self._parts.steps
        self._startup = "preparing the run"
        prep: PrepareOutput = await steps.call("prepare_run", PrepareInput(start.run_id, start.config, start.lineage), PrepareOutput)
        if workflow.patched(ADMISSION_QUEUE.name) and not await self._admitted(prep.run):
            return RunState(run=prep.run, kl_coef=start.plan.kl_coef)  # stopped in the queue: _run ends it
        self._startup = _warmup_label(start.config)
        warm: WarmupOutput = await steps.call("warmup", WarmupInput(prep.run), WarmupOutput)
        self._startup = "starting workers"
        await steps.call("start_workers", StartWorkersInput(prep.run, warm.policy_uri), StartWorkersOutput)
        state = RunState(
            run=prep.run,
            kl_coef=start.plan.kl_coef,
            safe_lambda=start.plan.safe_lambda,
            warmup_loss_first=warm.loss_first,
            warmup_loss_last=warm.loss_last,
        )
        self._scope.state = state
        if start.plan.evaluate:
            self._startup = "step-0 eval"
            await steps.evaluate(state, 0)
        return state

    async def _restore(self, start: TrainingInput) -> RunState:
        """A resume from a checkpoint's run state: store the (possibly changed) config and
        rebuild the workers at the checkpoint's version."""
        steps = self._parts.steps
        state = start.resume
        assert state is not None  # a restore starts from a checkpoint's run state
        steps.checkpointed_step = state.next_step  # the checkpoint it restores is that step's
        prep: PrepareOutput = await steps.call("prepare_run", PrepareInput(start.run_id, start.config, start.lineage), PrepareOutput)
        state.run = prep.run
        if workflow.patched(ADMISSION_QUEUE.name) and not await self._admitted(prep.run):
            return state  # stopped in the queue: _run ends it
        await steps.call("start_workers", StartWorkersInput(prep.run, "", restore_version=state.policy_version), StartWorkersOutput)
        # Older weights than the checkpoint's are not kept: no batch is scheduled on them.
        state.version_floor = state.policy_version
        self._scope.state = state
        await steps.sync_now(state)  # the new rollout worker serves the checkpoint's policy
        return state


def _summary(state: RunState, final_policy_uri: str, *, stopped: bool, unsafe_tools: list[str] | None = None) -> RunSummary:
    """The workflow's result, from the run state at its end."""
    return RunSummary(
        run_id=state.run.run_id,
        run_uri=state.run.run_uri,
        steps=state.next_step,
        policy_version=state.policy_version,
        final_policy_uri=final_policy_uri,
        reward_first10=sched.mean(state.reward_first10),
        reward_last10=sched.mean(state.reward_last10),
        eval_rewards=state.eval_rewards,
        warmup_loss_first=state.warmup_loss_first,
        warmup_loss_last=state.warmup_loss_last,
        stopped=stopped,
        dropped_samples=state.dropped_samples,
        unsafe_tools=list(unsafe_tools or []),
    )


def _warmup_label(config: dict) -> str:
    """The start-up phase while the warm-up runs: "warm-up (10 steps)"."""
    steps = (config.get("warmup") or {}).get("steps", 0)
    return f"warm-up ({steps} steps)" if steps else "warm-up (none)"
