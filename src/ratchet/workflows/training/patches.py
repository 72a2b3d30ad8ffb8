"""The training workflow's `workflow.patched` markers: why each exists, which recorded
history replays its old branch, and when it may go.

A marker keeps a run recorded before a change replaying the old way: that run's history
has no marker, so `workflow.patched(NAME)` is False there and True in every new run.

Retiring a marker (the policy):

1. Only histories that are still open need the old branch. A history ends when its run
   completes, fails, is stopped, or continues as new (a continue-as-new starts a new
   history under the code of the day, which records the marker). A resume from a
   checkpoint is a new workflow too. So a marker may go once no `TrainingWorkflow` run
   started before the marker's commit is still open: check with
   `temporal workflow list --query "WorkflowType='TrainingWorkflow' AND
   ExecutionStatus='Running' AND StartTime < '<the release date>'"`; a long-paused run can
   be stopped and resumed from its checkpoint to close its old history.
2. Then, for one release, `workflow.deprecate_patch(NAME)` replaces the `if
   workflow.patched(NAME)` and its old branch: new histories still carry the marker, so
   workers of the release before and after can share a task queue during a rolling deploy.
3. Then the marker goes, with the recorded history that replays its old branch (below) and
   the test that replays it.

`history` names that recording (relative to tests/), or None where none reaches the old
branch (the branch runs only in a situation no recording has: a sync run recorded before
the fused step, a server with search attributes, a drain). tests/unit/test_registries.py
checks that each named history exists and lacks its marker.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Patch:
    name: str  # what `workflow.patched` is given, and what a new history records
    why: str  # what the new branch does
    added: str  # the commit that added it: the retirement clock starts at its release
    history: str | None  # a recorded history that replays the old branch (tests/...), or None


FUSED_SYNC_STEP = Patch("sync-step-activity", "sync mode's step is one `step` activity, not four", "8004292", None)
SEARCH_ATTRIBUTES = Patch("search-attributes", "step, rewards and status upserted as search attributes", "8152c7a", None)
DRAIN_NODES = Patch("drain-nodes", "a `drain` signal moves the run off a node at the next step boundary", "849ce2f", None)
CHECKPOINT_ON_STOP = Patch(
    "checkpoint-on-stop",
    "a run stopped between checkpoints checkpoints the step it stopped at",
    "abe2d75",
    "e2e/histories/stop-before-checkpoint-on-stop.json.gz",
)
ADMISSION_QUEUE = Patch(
    "admission-queue",
    "a run waits in the cluster's admission queue for all its CPUs before it reserves any",
    "abe2d75",
    "faults/histories/pre-search-attributes-sync.json.gz",
)
RECORD_IN_NEXT_STEP = Patch(
    "record-in-next-step",
    "the next step's activity writes sync mode's metrics line (no local activity holding the step's task, ~8 ms)",
    "e5104b8",
    "faults/histories/pre-search-attributes-sync.json.gz",
)
STOP_BEFORE_CONTINUE_AS_NEW = Patch(
    "stop-before-continue-as-new",
    "a stop received in the step that continues as new ends the run there",
    "d809c6e",
    "faults/histories/stop-during-continue-as-new-step.json.gz",
)

PATCHES = (
    FUSED_SYNC_STEP, SEARCH_ATTRIBUTES, DRAIN_NODES, CHECKPOINT_ON_STOP, ADMISSION_QUEUE, RECORD_IN_NEXT_STEP,
    STOP_BEFORE_CONTINUE_AS_NEW,
)  # fmt: skip
