"""The workflow a Temporal Schedule starts: it launches one training run or one sweep,
named after the schedule and the moment it fired, and waits for it.

A schedule repeats one action with the same input, but every run needs an id (and a run
folder) of its own; Temporal suffixes the scheduled workflow's id with the fire time, and
this workflow turns that id into the run's or sweep's id and starts it as a child.
Waiting for the child makes the schedule's overlap policy (skip, by default) apply to the
runs themselves: a run still going when the next fire time comes is not doubled.
"""

from __future__ import annotations

import re
from dataclasses import replace

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from ratchet.sweep_types import LaunchInput, LaunchOutput, SweepSummary
    from ratchet.types import RunSummary
    from ratchet.workflows import search_attributes as sa

# The scheduled workflow's id is "<schedule id>.launch-<fire time>"; the launched run's is
# "<schedule id>-<fire time>", the time without the characters an id may not hold.
LAUNCH_SUFFIX = ".launch"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def launched_id(launcher_id: str) -> str:
    """The run or sweep id for the scheduled workflow `launcher_id`."""
    return _UNSAFE.sub("", launcher_id.replace(LAUNCH_SUFFIX + "-", "-", 1))[:128]


@workflow.defn(name="ScheduledLaunchWorkflow")
class ScheduledLaunchWorkflow:
    @workflow.run
    async def run(self, inp: LaunchInput) -> LaunchOutput:
        wid = launched_id(workflow.info().workflow_id)
        close = workflow.ParentClosePolicy.ABANDON  # deleting the schedule leaves its runs going
        if inp.kind == "run":
            assert inp.training is not None  # LaunchInput of kind "run" carries it
            training = replace(inp.training, run_id=wid)
            result = await workflow.execute_child_workflow(
                "TrainingWorkflow",
                training,
                id=wid,
                result_type=RunSummary,
                parent_close_policy=close,
                static_summary=sa.static_summary(wid, training.config, training.lineage),
                static_details=sa.static_details(wid, training.config, training.lineage),
                search_attributes=sa.initial_attributes(training.config, training.lineage) if training.search_attributes else None,
            )
            return LaunchOutput(wid, {"steps": result.steps, "reward_last10": result.reward_last10, "stopped": result.stopped})
        assert inp.sweep is not None  # LaunchInput of kind "sweep" carries it
        sweep = replace(inp.sweep, sweep_id=wid)
        summary = await workflow.execute_child_workflow(
            "SweepWorkflow",
            sweep,
            id=wid,
            result_type=SweepSummary,
            parent_close_policy=close,
            static_summary=f"sweep {wid} (schedule {inp.schedule_id})",
        )
        best = summary.best
        return LaunchOutput(
            wid, {"status": summary.status, "trials": len(summary.trials), "best_trial": best.trial_index if best else None}
        )
