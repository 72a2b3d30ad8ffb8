"""Releasing the actors of runs that closed without releasing them.

Whether a run is closed is Temporal's to say, so that query lives here; the worker layer
(`workers/actors/names.py: release_closed_runs`) does the releasing.
"""

from __future__ import annotations

import logging

from ratchet.workers.actors import release_closed_runs

log = logging.getLogger(__name__)

# Temporal's closed states; a run that is not found is closed too (its history is gone).
_OPEN = "RUNNING"


async def run_is_open(client, run_id: str) -> bool:
    """Whether workflow `run_id` (its latest execution) is still running. Errors other than
    not-found count as open: when in doubt, an actor is kept."""
    from temporalio.service import RPCError, RPCStatusCode

    try:
        desc = await client.get_workflow_handle(run_id).describe()
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return False
        log.warning("cannot tell whether run %s is open (%s); keeping its actors", run_id, exc)
        return True
    return desc.status is not None and desc.status.name == _OPEN


async def sweep_closed_runs(client) -> dict[str, list[str]]:
    """Release the actors of every run whose workflow is closed (completed, failed,
    cancelled, terminated, timed out) or unknown. Returns {run id: actor names killed}."""
    return await release_closed_runs(lambda run_id: run_is_open(client, run_id))
