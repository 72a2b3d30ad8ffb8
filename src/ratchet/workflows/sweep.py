"""The sweep workflow: trials of one base config as child training workflows, at most
`parallelism` at once, weak ones stopped early, the best one reported.

Durability comes from Temporal and from naming: trial k is the child workflow
`<sweep_id>-t<k>` (its run id too), started once and recorded in this workflow's history,
so a replay after a killed worker or a restarted server finds the trials already running
and starts none twice; its values come from an activity that asks Optuna once per index
(activities/sweep_trials.py), and the registry rows are upserted by (sweep, trial).

Early stopping waits on an activity that reads the running trials' `metrics.jsonl` every
`poll_seconds` and returns once one reaches a new rung (one call per rung reached, so
the history stays small), and the rule (workflows/early_stopping.py)
decides in workflow code, on values that are in the history. A trial waits at each rung
until it is judged (its `hold_at_steps`): one to stop gets the training workflow's own
`stop` signal (it evaluates, exports and completes) and is marked pruned, the others
`pass_rung`. A trial never runs a step past a rung it was stopped at, however fast its
steps and however slow the sweep's worker; nor past a step it was stopped in as it continued
as new (the training workflow ends there instead). Signals `pause`, `resume` and `cancel` act on
the whole sweep: the running trials are paused, resumed or stopped, and no new trial
starts while paused or once cancelled.

Deterministic like the training workflow (docs/design.md, rule 8): no Optuna, no file reads,
no clocks but Temporal's timers; activities by name, types from `ratchet.sweep_types`.
A sweep's history grows by a few events per trial and rung (and per minute without a
rung reached); continue-as-new is not implemented: hundreds of trials stay far below
Temporal's limits.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ChildWorkflowError

with workflow.unsafe.imports_passed_through():
    from ratchet.sweep_types import (
        FinishTrialInput,
        PlanTrialInput,
        RungInput,
        RungReport,
        SweepBeginInput,
        SweepEndInput,
        SweepInput,
        SweepProgress,
        SweepSummary,
        TrialPlan,
        TrialResult,
        TrialWatch,
        trial_run_id,
    )
    from ratchet.types import RunCommand, RunLineage, RunSummary, TrainingInput
    from ratchet.workflows import commands
    from ratchet.workflows import early_stopping as es
    from ratchet.workflows import search_attributes as sa

RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=20),
    maximum_attempts=20,
    non_retryable_error_types=["TrialConfigInvalid", "SweepStorage"],
)
# Short: these activities do a few database or file operations, and a worker killed
# during one is noticed only when an attempt times out.
TIMEOUTS = {
    "sweep_begin": timedelta(seconds=30),
    "plan_trial": timedelta(seconds=30),
    "finish_trial": timedelta(seconds=30),
    "sweep_status": timedelta(seconds=30),
}

# Trials wait at their rungs for the sweep's verdict (`pass_rung` or `stop`); sweeps
# started before it let them run on and judged them when it could.
TRIALS_HOLD_AT_RUNGS = "trials-hold-at-rungs"

# Longest one `trial_rungs` call waits for a rung before it reports nothing new.
RUNG_WAIT_S = 60.0


@workflow.defn(name="SweepWorkflow")
class SweepWorkflow:
    # The input at construction (workflow.init): a signal or query that comes before `run`
    # starts (signal-with-start, a query on a fresh sweep) finds it.
    @workflow.init
    def __init__(self, inp: SweepInput) -> None:
        self._inp: SweepInput = inp
        self._paused = False
        self._cancelling = False
        self._launched = False  # every trial that will start has started
        self._started = 0
        self._running: dict[int, workflow.ChildWorkflowHandle | None] = {}  # None while being planned
        self._plans: dict[int, TrialPlan] = {}
        self._results: dict[int, TrialResult] = {}
        self._rung_values: dict[int, dict[int, float | None]] = {}  # rung -> trial -> value
        self._rungs_seen: dict[int, int] = {}
        self._pruned_at: dict[int, int] = {}
        self._trials_hold = False  # trials wait at each rung for `pass_rung` (TRIALS_HOLD_AT_RUNGS)

    # -- signals and queries ---------------------------------------------------------------

    @workflow.signal
    async def pause(self, command: RunCommand | None = None) -> None:
        """Pause the running trials (at their next step boundary); start no new ones."""
        if not commands.accepted("pause", command):
            return
        if self._paused or self._cancelling:
            return
        self._paused = True
        await self._signal_all("pause")
        await self._act("sweep_status", SweepEndInput(self._inp.sweep_id, "paused"))

    @workflow.signal
    async def resume(self, command: RunCommand | None = None) -> None:
        if not commands.accepted("resume", command):
            return
        if not self._paused:
            return
        self._paused = False
        await self._signal_all("resume")
        if not self._cancelling:
            await self._act("sweep_status", SweepEndInput(self._inp.sweep_id, "running"))

    @workflow.signal
    async def cancel(self, command: RunCommand | None = None) -> None:
        """Stop the running trials (each ends at a step boundary, keeping what it did) and
        start no new ones; the sweep completes as cancelled with the best trial so far."""
        if not commands.accepted("cancel", command):
            return
        if self._cancelling:
            return
        self._cancelling = True
        self._paused = False
        await self._signal_all("stop")

    @workflow.query
    def progress(self) -> SweepProgress:
        inp = self._inp
        plan = inp.plan
        status = "cancelling" if self._cancelling else "paused" if self._paused else "running"
        if self._launched and not self._running:
            status = "cancelled" if self._cancelling else "completed"
        return SweepProgress(
            sweep_id=inp.sweep_id,
            status=status,
            total=plan.trials,
            started=self._started,
            running=sorted(self._running),
            finished=[self._results[k] for k in sorted(self._results)],
            best=self._best(),
            rung_values={
                str(r): {str(k): v for k, v in sorted(vals.items()) if v is not None} for r, vals in sorted(self._rung_values.items())
            },
        )

    # -- the sweep ---------------------------------------------------------------------------

    @workflow.run
    async def run(self, inp: SweepInput) -> SweepSummary:
        plan = inp.plan
        await self._act("sweep_begin", SweepBeginInput(inp.sweep_id, inp.spec))
        judged = plan.stop_rule != "none" and bool(plan.rungs)
        self._trials_hold = judged and workflow.patched(TRIALS_HOLD_AT_RUNGS)
        monitor = asyncio.ensure_future(self._monitor()) if judged else None
        trials: list[asyncio.Future] = []
        for k in range(plan.trials):
            await workflow.wait_condition(lambda: self._cancelling or (not self._paused and len(self._running) < plan.parallelism))
            if self._cancelling:
                break
            self._running[k] = None
            self._started += 1
            trials.append(asyncio.ensure_future(self._trial(k)))
        if trials:
            await asyncio.gather(*trials)
        self._launched = True
        if monitor is not None:
            await monitor
        best = self._best()
        status = "cancelled" if self._cancelling else "completed"
        await self._act("sweep_status", SweepEndInput(inp.sweep_id, status, best.trial_index if best else None))
        await workflow.wait_condition(workflow.all_handlers_finished)
        return SweepSummary(sweep_id=inp.sweep_id, status=status, trials=[self._results[k] for k in sorted(self._results)], best=best)

    def _best(self) -> TrialResult | None:
        done = {k: r.objective for k, r in self._results.items() if r.state == "completed" and r.objective is not None}
        k = es.best_index(done, self._inp.plan.direction)
        return None if k is None else self._results[k]

    async def _act(self, name: str, arg, result_type=None):
        return await workflow.execute_activity(
            name, arg, result_type=result_type, start_to_close_timeout=TIMEOUTS[name], retry_policy=RETRY
        )

    async def _trial(self, k: int) -> None:
        inp = self._inp
        run_id = trial_run_id(inp.sweep_id, k)
        finish = FinishTrialInput(
            sweep_id=inp.sweep_id, spec=inp.spec, trial_index=k, run_id=run_id, storage_root="", params={}, state="failed"
        )
        try:
            try:
                plan: TrialPlan = await self._act("plan_trial", PlanTrialInput(inp.sweep_id, inp.spec, inp.base_config, k), TrialPlan)
            except ActivityError as exc:
                finish.error = str(exc.cause or exc)
                workflow.logger.warning("sweep %s: trial %d could not be planned: %s", inp.sweep_id, k, finish.error)
                return await self._finish(finish)
            self._plans[k] = plan
            finish.params, finish.storage_root = plan.params, plan.storage_root
            if self._cancelling:
                finish.state = "cancelled"
                return await self._finish(finish)
            summary = await self._run_child(k, plan, finish)
            if summary is not None:
                finish.steps, finish.eval_rewards = summary.steps, dict(summary.eval_rewards)
                if summary.stopped and k in self._pruned_at:
                    finish.state, finish.pruned_at = "pruned", self._pruned_at[k]
                elif summary.stopped and self._cancelling:
                    finish.state = "cancelled"
                else:
                    finish.state = "completed"
        finally:
            self._running.pop(k, None)
        await self._finish(finish)

    async def _finish(self, finish: FinishTrialInput) -> None:
        self._results[finish.trial_index] = await self._act("finish_trial", finish, TrialResult)

    async def _run_child(self, k: int, plan: TrialPlan, finish: FinishTrialInput) -> RunSummary | None:
        inp = self._inp
        lineage = RunLineage(sweep_id=inp.sweep_id, trial_index=k)
        child_input = TrainingInput(
            run_id=plan.run_id,
            config=plan.config,
            plan=plan.plan,
            lineage=lineage,
            search_attributes=inp.search_attributes,
            hold_at_steps=list(inp.plan.rungs) if self._trials_hold else [],
        )
        extra = {}
        if inp.search_attributes:
            extra["search_attributes"] = sa.initial_attributes(plan.config, lineage)
        handle = await workflow.start_child_workflow(
            "TrainingWorkflow",
            child_input,
            id=plan.run_id,
            result_type=RunSummary,
            # A sweep terminated from outside cancels its trials, which release their actors.
            parent_close_policy=workflow.ParentClosePolicy.REQUEST_CANCEL,
            static_summary=sa.static_summary(plan.run_id, plan.config, lineage),
            static_details=sa.static_details(plan.run_id, plan.config, lineage),
            **extra,
        )
        self._running[k] = handle
        if self._cancelling:
            await self._signal(k, "stop")
        elif self._paused:
            await self._signal(k, "pause")
        try:
            return await handle
        except ChildWorkflowError as exc:
            finish.error = str(exc.cause or exc)
            workflow.logger.warning("sweep %s: trial %d failed: %s", inp.sweep_id, k, finish.error)
            return None

    async def _signal(self, k: int, name: str, *args) -> None:
        """Signal trial `k`; `pause`, `resume` and `stop` carry a RunCommand for the trial
        (stamped with the sweep's workflow clock), as a trial acts on no other."""
        handle = self._running.get(k)
        if handle is None:
            return
        if name in ("pause", "resume", "stop"):
            args = (RunCommand(handle.id),)
        try:
            await handle.signal(name, *args)
        except Exception as exc:  # noqa: BLE001 - the trial ended meanwhile: nothing to signal
            workflow.logger.info("sweep %s: signal %s to trial %d not delivered: %s", self._inp.sweep_id, name, k, exc)

    async def _signal_all(self, name: str) -> None:
        await asyncio.gather(*(self._signal(k, name) for k in sorted(self._running)))

    # -- early stopping ------------------------------------------------------------------------

    def _watches(self) -> list[TrialWatch]:
        """The running trials with rungs still ahead of them (none while paused)."""
        if self._paused or self._cancelling:
            return []
        rungs = self._inp.plan.rungs
        return [
            TrialWatch(k, self._plans[k].run_id, self._plans[k].storage_root, self._rungs_seen.get(k, 0))
            for k, handle in sorted(self._running.items())
            if handle is not None and k not in self._pruned_at and self._rungs_seen.get(k, 0) < len(rungs)
        ]

    async def _monitor(self) -> None:
        """Wait for rungs: one `trial_rungs` activity at a time returns when a watched trial
        reaches a new rung; it is cancelled and asked again when the watched trials change."""
        plan = self._inp.plan
        spec_es = self._inp.spec.get("early_stopping", {})
        metric, window = spec_es.get("metric", "reward_mean"), int(spec_es.get("window", 1))
        done = lambda: self._launched and not self._running  # noqa: E731
        while not done():
            watches = self._watches()
            if not watches:
                await workflow.wait_condition(lambda: done() or bool(self._watches()))
                continue
            key = [(w.trial_index, w.rungs_seen) for w in watches]
            call = workflow.start_activity(
                "trial_rungs",
                RungInput(watches, plan.rungs, metric, window, poll_seconds=plan.poll_seconds, max_wait_seconds=RUNG_WAIT_S),
                result_type=list[RungReport],
                start_to_close_timeout=timedelta(seconds=RUNG_WAIT_S + 60),
                heartbeat_timeout=timedelta(seconds=max(10.0, 3 * plan.poll_seconds)),
                retry_policy=RETRY,
            )
            await workflow.wait_condition(lambda: call.done() or done() or [(w.trial_index, w.rungs_seen) for w in self._watches()] != key)
            if not call.done():
                call.cancel()
                try:
                    await call
                except (ActivityError, asyncio.CancelledError):
                    pass
                continue
            for rep in sorted(call.result(), key=lambda r: r.trial_index):
                await self._judge(rep)

    async def _judge(self, rep: RungReport) -> None:
        """Record the trial's values at its newly reached rungs; stop it at the first rung
        where the rule says so, else let it go on past them."""
        plan, k = self._inp.plan, rep.trial_index
        seen = self._rungs_seen.get(k, 0)
        for i, value in enumerate(rep.values):
            rung = plan.rungs[seen + i]
            at_rung = self._rung_values.setdefault(rung, {})
            others = [v for t, v in sorted(at_rung.items()) if t != k and v is not None]
            at_rung[k] = value
            self._rungs_seen[k] = seen + i + 1
            if value is None or k not in self._running or self._cancelling:
                continue
            direction = plan.stop_direction or plan.direction
            if es.should_stop(plan.stop_rule, value, others, eta=plan.eta, direction=direction, min_trials=plan.min_trials):
                self._pruned_at[k] = rung
                workflow.logger.info("sweep %s: stopping trial %d at rung %d (%s %.4f)", self._inp.sweep_id, k, rung, plan.stop_rule, value)
                await self._signal(k, "stop")
                return
        if rep.values and self._trials_hold:  # it waits at the rung for the verdict
            await self._signal(k, "pass_rung", plan.rungs[seen + len(rep.values) - 1])
