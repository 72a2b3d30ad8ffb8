"""What every part of one training workflow run reads: the plan, the run state once it
exists, and the phase the progress query shows."""

from __future__ import annotations

from dataclasses import dataclass

from ratchet.types import LoopPlan, RunState


@dataclass
class RunScope:
    run_id: str
    plan: LoopPlan
    state: RunState | None = None  # None until the run is prepared (or taken from a resume)
    phase: str = "starting"  # the activity being called, or how the run ended

    @property
    def next_step(self) -> int:
        return self.state.next_step if self.state else 0
