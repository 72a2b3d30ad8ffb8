"""Releasing a run's actors, its resource pools and its admission: on every way out of a
run (completion, failure, cancellation), and for the runs a worker finds closed."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from .admission import leave, ledger_runs
from .names import kill_named, pool_group_runs, remove_pool_groups, run_actor_names

log = logging.getLogger(__name__)


def release_run_actors(run_id: str, *, timeout_s: float = 30.0, keep_admission: bool = False) -> list[str]:
    """Kill every named actor of run `run_id` (whatever roles and world size it had) and
    wait for their names to be free; returns the names killed. Needs no config, so it
    works on every way out of a run, also when the run failed before its config was stored.
    The run's resource pools (placement groups) go with them, and (unless
    `keep_admission`: a restore rebuilding them at once) its admission grant or its place
    in the queue (admission.py)."""
    killed = kill_named(run_actor_names().get(run_id, []), timeout_s)
    removed = remove_pool_groups(run_id)
    if removed:
        log.info("run %s: removed placement groups %s", run_id, ", ".join(removed))
    if not keep_admission and leave(run_id):
        log.info("run %s: released its admission grant", run_id)
    return killed


async def release_closed_runs(run_is_open: Callable[[str], Awaitable[bool]]) -> dict[str, list[str]]:
    """Release the actors of every run that `run_is_open` says is closed: a worker that
    died with its run, or a run terminated from outside, leaves detached actors that hold
    their CPUs forever otherwise. Returns {run id: actor names killed}. The caller knows
    how to tell an open run (a Temporal query); this layer does not."""
    runs = set(await asyncio.to_thread(run_actor_names)) | set(await asyncio.to_thread(pool_group_runs))
    runs |= set(await asyncio.to_thread(ledger_runs))  # granted or queued, maybe with no actor yet
    released = {}
    for run_id in sorted(runs):
        if await run_is_open(run_id):
            continue
        released[run_id] = await asyncio.to_thread(release_run_actors, run_id)
        log.warning("run %s is closed; released its leftover actors %s", run_id, ", ".join(released[run_id]))
    return released
