"""The training workflow: warm-up, then RL steps in one of the loop modes, as a package of
one job per module.

- workflow.py: the shell (signals, queries, the `set_params` update) and the run from
  start or restore to continue-as-new or the end;
- control.py: the commands received (pause, stop, drain) and a sweep trial's rungs;
- boundary.py: the step boundary, where those commands and live changes take effect;
- steps.py: the step calls (generate and score, the fused sync step, train, sync,
  checkpoint, evaluate) and the batches in flight;
- recorder.py: counting a step, writing its metrics line, showing the run in the UI;
- loops/: one module per loop mode (sync, one_step_off, fully_async), named by the catalog
  (src/ratchet/catalog/loop_modes.py);
- patches.py: the `workflow.patched` markers, the histories that replay them, and the policy
  for retiring them;
- scope.py, parts.py: what every part reads, and the parts a loop drives.

The maths of the schedule (which version generates a batch, when the producer may start
one, when a sync or checkpoint is due, what a checkpoint keeps of the work in flight, the
metrics line) are pure functions in workflows/scheduling.py, and how each activity is
called (time limits, heartbeats, retries) is workflows/phases.py.
"""

from .workflow import TrainingWorkflow

__all__ = ["TrainingWorkflow"]
