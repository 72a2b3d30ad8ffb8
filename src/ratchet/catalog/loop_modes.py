"""Every loop mode a config can name (`loop.mode`), in one table: where a loop mode is added.

A mode is a coroutine method of `TrainingWorkflow` (workflows/training.py) that runs the
steps of one run segment and returns True when the run should continue as new; the
workflow calls the method this table names, and the config schema accepts exactly these
names. To add one: write the method (its scheduling maths as pure functions in
scheduling.py, unit-tested in tests/unit/test_scheduling.py), add its line below, and add an
end-to-end run in tests/e2e/test_async.py (or test_e2e.py) that trains in the new mode.
tests/unit/test_registries.py checks that the table and the workflow's methods agree.

Standard library only (with the catalog's `Registry`): the config schema and the Temporal
sandbox both import it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .registry import Registry


@dataclass(frozen=True)
class LoopMode:
    method: str  # the TrainingWorkflow method that runs the loop
    description: str


LOOP_MODES: Registry[LoopMode] = Registry("loop mode")
LOOP_MODES.register("sync", LoopMode("_sync_loop", "rollout, score, train, sync in order."))
LOOP_MODES.register("one_step_off", LoopMode("_one_step_off_loop", "batch n+1 is generated (weights of step n) while step n trains."))
LOOP_MODES.register("fully_async", LoopMode("_fully_async_loop", "rollouts run ahead of the trainer, within max_staleness."))
