"""Which `pause`, `resume`, `stop` (a training run) and `pause`, `resume`, `cancel` (a
sweep) signals a workflow acts on: those carrying a RunCommand for this workflow
(ratchet/types.py, RunCommand, says why).

A signal without one (a plain Temporal client without the payload key) or with a command
for another workflow is ignored, with a warning in the worker's log.
Histories recorded before commands were checked (a plain signal accepted) replay as they
ran: the check is behind `workflow.patched(PATCH)`, asked only when a command would be
refused, so a new history holds the marker exactly where a refusal happened.
"""

from __future__ import annotations

from temporalio import workflow

from ratchet.types import RunCommand

PATCH = "authenticated-commands"


def accepted(signal: str, command: RunCommand | None) -> bool:
    """Whether the workflow acts on `signal` carrying `command` (workflow code only)."""
    if command is None:
        why = "without an authenticated command"
    else:
        refusal = command.refusal(workflow.info().workflow_id)
        if refusal is None:
            return True
        why = f"with a command refused ({refusal})"
    if not workflow.patched(PATCH):
        return True  # replaying a history from before the check: the signal was accepted then
    workflow.logger.warning("signal %r %s: ignored; send it with ratchet's client, which holds the payload key", signal, why)
    return False
