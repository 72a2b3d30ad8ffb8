"""The training workflow's live hyper-parameters: the `set_params` update's check, the
changes waiting for the next step boundary, and their place in the run state and the
metrics line.

A change is checked twice with the same pure function (src/ratchet/config/live_keys.py): by
the update's validator, which refuses it before it enters the history, and by the handler,
which stores the values as the config's fields hold them (the handler also runs on replay,
the validator does not). It waits in `pending` until the loop reaches a step boundary, so
an update in flight trains with the values it started with; then it moves into
`RunState.live` (carried across continue-as-new and into every checkpoint) and from there
into every `step` / `train` activity input. Deterministic: no I/O, no clocks.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow
from temporalio.exceptions import ApplicationError

from ratchet.types import LiveChange, RunState

with workflow.unsafe.imports_passed_through():
    # pydantic and the schema: the worker process has them loaded; not re-imported per run.
    from ratchet.config import live_keys
    from ratchet.config.loader import ConfigError

REFUSED = "LiveParamsRefused"  # the ApplicationError type a client sees for a refused change


class LiveSettings:
    """What one workflow run holds of the live values besides the run state."""

    def __init__(self) -> None:
        self.config: dict[str, Any] = {}
        self.pending: dict[str, Any] = {}  # accepted, applied at the next step boundary
        self.step_running = False  # between a step's boundary and its metrics line

    def check(self, state: RunState | None, values: dict[str, Any], *, closing: str | None) -> dict[str, Any]:
        """The changes as the config fields hold them, or an ApplicationError naming each
        refused key (the client shows its message as it is)."""
        if closing:
            raise ApplicationError(f"the run cannot change now: {closing}", type=REFUSED, non_retryable=True)
        current = {**(state.live.values if state else {}), **self.pending}
        try:
            with workflow.unsafe.imports_passed_through():  # pydantic imports lazily
                return live_keys.check_live_changes(self.config, current, values)
        except ConfigError as exc:
            text = "; ".join(f"{key}: {why}" for key, why in exc.issues)
            raise ApplicationError(f"refused: {text}", type=REFUSED, non_retryable=True) from None

    def accept(self, run_id: str, state: RunState | None, values: dict[str, Any]) -> LiveChange:
        in_force = live_keys.effective_values(self.config, {**(state.live.values if state else {}), **self.pending})
        self.pending.update(values)
        step = state.next_step + (1 if self.step_running else 0) if state else 0
        return LiveChange(run_id=run_id, from_step=step, values=dict(values), previous={k: in_force.get(k) for k in values})

    def apply(self, state: RunState) -> None:
        """At a step boundary (and before continue-as-new): the pending changes take effect
        from step `state.next_step`."""
        self.step_running = True
        if not self.pending:
            return
        state.live.values.update(self.pending)
        state.live.changes += 1
        state.live.last_step = state.next_step
        if "algorithm.kl.coef" in self.pending:
            state.kl_coef = float(self.pending["algorithm.kl.coef"])  # the controller carries on from it
        if workflow.in_workflow():  # (the unit tests call this outside one)
            workflow.logger.info("run %s: from step %d: %s", state.run.run_id, state.next_step, self.pending)
        self.pending = {}


def step_metrics(state: RunState, step: int) -> dict[str, float]:
    """The metrics line's live part: each value set live (a list as `key.0`, `key.1`), and
    `live_changed` = 1 on the step a change applies from."""
    out: dict[str, float] = {}
    for key, value in state.live.values.items():
        if isinstance(value, (list, tuple)):
            out.update({f"{key}.{i}": float(v) for i, v in enumerate(value)})
        else:
            out[key] = float(value)
    if state.live.last_step == step:
        out["live_changed"] = 1.0
    return out
