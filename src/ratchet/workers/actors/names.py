"""Named, detached actors: their names, finding them and killing them (releasing a whole
run: release.py).

Actors are named `<run id>/<role>-<rank>` in the `ratchet` namespace and detached, so a
restarted Temporal worker process finds the same actors instead of orphaning them.
"""

from __future__ import annotations

import time
from collections import defaultdict

import ray

from ratchet.ids import is_valid_id


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
