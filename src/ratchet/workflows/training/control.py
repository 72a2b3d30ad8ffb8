"""Run control: the pause, stop and drain commands a training run has received, and a
sweep trial's rungs. Each takes effect at a step boundary (boundary.py); this holds what
was asked for and answers the questions a loop asks of it."""

from __future__ import annotations

from ratchet.types import CarriedCommands, LoopPlan, RunState


class RunControl:
    def __init__(self, carried: CarriedCommands, hold_at_steps: list[int]) -> None:
        # A pause, and nodes to drain, that the run before a continue-as-new had received
        # and not acted on (TrainingInput.carried): taken here, so that a signal of the
        # first task (a resume) applies on top of them.
        self.paused = carried.paused
        self.draining: list[str] = list(carried.draining)  # Ray node ids about to go (`drain`), not yet moved off
        self.stopping = False
        self.held_at_boundary = False  # the loop waits at a step boundary while paused
        self.hold_at_steps = list(hold_at_steps)  # a sweep trial's rungs (TrainingInput.hold_at_steps)
        self.rung_passed = 0  # `pass_rung` before the state exists (a continued run's first task)
        self.held_at_rung: int | None = None  # the rung the loop waits at for the sweep's verdict

    def pass_rung(self, step: int, state: RunState | None) -> None:
        self.rung_passed = max(self.rung_passed, step)
        if state is not None:
            state.rung_passed = max(state.rung_passed, step)

    def drain(self, node_id: str) -> None:
        if node_id not in self.draining:
            self.draining.append(node_id)

    def holds_at(self, state: RunState, step: int) -> bool:
        """A sweep trial stops at each rung until the sweep has judged it there."""
        return step in self.hold_at_steps and state.rung_passed < step and not self.stopping

    def may_prefetch(self, state: RunState, plan: LoopPlan) -> bool:
        """Whether the next step's prompts may be read ahead: not for a step that may not
        come (after a stop or a pause, or at a rung)."""
        return state.next_step + 1 < plan.steps and not (self.stopping or self.paused or self.holds_at(state, state.next_step + 1))

    def rung_phase(self) -> str:
        return "" if self.held_at_rung is None else f"waiting for the sweep's verdict at step {self.held_at_rung}"
