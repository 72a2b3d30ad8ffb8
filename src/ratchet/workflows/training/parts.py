"""The parts of one training workflow run that a loop mode drives: what it reads (scope),
the commands it obeys (control), the step calls, the metrics recorder and the live
hyper-parameters. The workflow builds them once per run (workflow.py); a loop mode is a
function of them (loops/)."""

from __future__ import annotations

from dataclasses import dataclass

from temporalio import workflow

from ratchet.types import LoopPlan, RunState
from ratchet.workflows import live
from ratchet.workflows import scheduling as sched

from .control import RunControl
from .recorder import StepRecorder
from .scope import RunScope
from .steps import StepCalls


@dataclass
class RunParts:
    scope: RunScope
    control: RunControl
    steps: StepCalls
    recorder: StepRecorder
    live: live.LiveSettings

    def continue_as_new_due(self, state: RunState, plan: LoopPlan) -> bool:
        suggested = workflow.info().is_continue_as_new_suggested()
        return sched.continue_as_new_due(plan, state.next_step, suggested=suggested)
