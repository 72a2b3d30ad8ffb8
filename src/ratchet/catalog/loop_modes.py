"""Every loop mode a config can name (`loop.mode`), in one table: where a loop mode is added.

A mode is a module of its own under workflows/training/loops/ with a coroutine function
`run(parts, state, plan) -> bool` that trains the steps of one run segment and returns True
when the run should continue as new. This table names it as "module:function"; the
workflow calls the one a run's `loop.mode` names, and the config schema accepts exactly
these names. To add one: write the module (its scheduling maths as pure functions in
workflows/scheduling.py, unit-tested in tests/unit/test_scheduling.py), add its line below,
and add an end-to-end run in tests/e2e/test_async.py (or test_e2e.py) that trains in the
new mode (docs/architecture.md, "A loop mode"). tests/unit/test_registries.py checks that
every entry resolves to such a function.

Standard library only (with the catalog's `Registry`): the config schema and the Temporal
sandbox both import it, and the loop's module is imported only when a workflow runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .registry import Registry, resolve


@dataclass(frozen=True)
class LoopMode:
    run: str  # "module:function" of the loop, function(parts, state, plan) -> bool (continue as new)
    description: str

    def loop(self) -> Callable[..., Any]:
        return resolve(self.run)


_LOOPS = "ratchet.workflows.training.loops"
LOOP_MODES: Registry[LoopMode] = Registry("loop mode")
LOOP_MODES.register("sync", LoopMode(f"{_LOOPS}.sync:run", "rollout, score, train, sync in order."))
LOOP_MODES.register(
    "one_step_off", LoopMode(f"{_LOOPS}.one_step_off:run", "batch n+1 is generated (weights of step n) while step n trains.")
)
LOOP_MODES.register("fully_async", LoopMode(f"{_LOOPS}.fully_async:run", "rollouts run ahead of the trainer, within max_staleness."))
