"""Named, detached actors: finding them, and releasing a run's actors.

Actors are named `<run id>/<role>-<rank>` in the `ratchet` namespace and detached, so a
restarted Temporal worker process finds the same actors instead of orphaning them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable

import ray

from ratchet.ids import is_valid_id

log = logging.getLogger(__name__)

NAMESPACE = "ratchet"


class Role:
    """The actor roles of a run (the `<role>` in an actor's name)."""

    TRAINER = "trainer"
    ROLLOUT = "rollout"
    REWARD = "reward"
    CRITIC = "critic"


def actor_name(run_id: str, role: str, rank: int = 0) -> str:
    return f"{run_id}/{role}-{rank}"


def role_of(name: str) -> str:
    """`trainer` for `run/trainer-1`."""
    return name.partition("/")[2].rpartition("-")[0]


def find_named(name: str):
    """The live actor of that name, or None."""
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def wait_name_free(name: str, timeout_s: float = 30.0) -> None:
    """The kill of a named actor is asynchronous: wait until the name is free, or a new
    actor created with get_if_exists would be the dying one."""
    deadline = time.monotonic() + timeout_s
    while find_named(name) is not None and time.monotonic() < deadline:
        time.sleep(0.1)


def kill_named(names: list[str], timeout_s: float = 30.0) -> list[str]:
    """Kill these actors (a missing one is skipped) and wait until their names are free;
    returns the names that were alive."""
    killed = []
    for name in names:
        actor = find_named(name)
        if actor is not None:
            ray.kill(actor, no_restart=True)
            killed.append(name)
    deadline = time.monotonic() + timeout_s
    for name in killed:
        wait_name_free(name, max(0.0, deadline - time.monotonic()))
    return killed


def pool_group_name(run_id: str, pool: str) -> str:
    """The placement group of resource pool `pool` of run `run_id` (placement.py)."""
    return f"{run_id}/pool-{pool}"


def run_pool_groups(run_id: str) -> dict[str, object]:
    """The run's live placement groups by name (none unless it has resources.pools)."""
    from ray.util import get_placement_group, placement_group_table

    prefix = pool_group_name(run_id, "")
    names = {
        info.get("name", "")
        for info in placement_group_table().values()
        if info.get("name", "").startswith(prefix) and info.get("state") != "REMOVED"
    }
    out = {}
    for name in sorted(names):
        try:
            out[name] = get_placement_group(name)
        except ValueError:  # removed meanwhile
            pass
    return out


def pool_group_runs() -> list[str]:
    """The run ids that hold placement groups (a run that failed between reserving its
    pools and creating its actors holds them with no actor)."""
    from ray.util import placement_group_table

    out = set()
    for info in placement_group_table().values():
        run_id, sep, rest = info.get("name", "").partition("/")
        if sep and rest.startswith("pool-") and info.get("state") != "REMOVED" and is_valid_id(run_id):
            out.add(run_id)
    return sorted(out)


def remove_pool_groups(run_id: str) -> list[str]:
    """Remove the run's placement groups (after its actors: an actor in a removed group dies)."""
    from ray.util import remove_placement_group

    groups = run_pool_groups(run_id)
    for group in groups.values():
        remove_placement_group(group)
    return sorted(groups)


def run_actor_names() -> dict[str, list[str]]:
    """Named actors in the `ratchet` namespace by run id (the name before '/')."""
    out: dict[str, list[str]] = defaultdict(list)
    for entry in ray.util.list_named_actors(all_namespaces=True):
        run_id, sep, _ = entry["name"].partition("/")
        if entry["namespace"] == NAMESPACE and sep and is_valid_id(run_id):
            out[run_id].append(entry["name"])
    return {k: sorted(v) for k, v in out.items()}


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
    if not keep_admission:
        from .admission import leave  # admission.py imports this module

        if leave(run_id):
            log.info("run %s: released its admission grant", run_id)
    return killed


async def release_closed_runs(run_is_open: Callable[[str], Awaitable[bool]]) -> dict[str, list[str]]:
    """Release the actors of every run that `run_is_open` says is closed: a worker that
    died with its run, or a run terminated from outside, leaves detached actors that hold
    their CPUs forever otherwise. Returns {run id: actor names killed}. The caller knows
    how to tell an open run (a Temporal query); this layer does not."""
    from .admission import ledger_runs  # admission.py imports this module

    runs = set(await asyncio.to_thread(run_actor_names)) | set(await asyncio.to_thread(pool_group_runs))
    runs |= set(await asyncio.to_thread(ledger_runs))  # granted or queued, maybe with no actor yet
    released = {}
    for run_id in sorted(runs):
        if await run_is_open(run_id):
            continue
        released[run_id] = await asyncio.to_thread(release_run_actors, run_id)
        log.warning("run %s is closed; released its leftover actors %s", run_id, ", ".join(released[run_id]))
    return released
