"""Moving a run's actors off nodes that are about to go (a spot reclaim, a Kubernetes
drain): `ratchet drain NODE` marks the node draining in Ray, so nothing new is placed on
it, and asks each run with actors there to move them at its next step boundary.

The run checkpoints first; then its actors on the node are killed (and the resource pools
with a bundle there removed, so Ray reserves them again on the other nodes). The next step
finds them gone and rebuilds them from that checkpoint, which holds the version the
workflow expects: nothing is replayed, where an unannounced loss replays every update
since the last checkpoint.

Which node holds an actor comes from Ray's actor table (the public state API needs the
dashboard, which ratchet's head runs without).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import ray

from .names import NAMESPACE, kill_named, pool_group_name, run_actor_names, run_pool_groups

if TYPE_CHECKING:
    from .run_actors import RunActors

log = logging.getLogger(__name__)


def alive_nodes() -> dict[str, str]:
    """{node id (hex): node name} of the live nodes."""
    return {n["NodeID"]: n.get("NodeName", "") for n in ray.nodes() if n.get("Alive")}


def resolve_node(spec: str) -> str:
    """The id of the live node named `spec` (its Ray node name such as `node-2`, its id or
    a unique prefix of it, or its address when only one node has it); ValueError otherwise."""
    return pick_node(spec, ray.nodes())


def pick_node(spec: str, nodes: list[dict]) -> str:
    """`resolve_node` over the node table `nodes` (as `ray.nodes()` gives it)."""
    nodes = [n for n in nodes if n.get("Alive")]
    for key in ("NodeName", "NodeID"):
        exact = [n for n in nodes if n.get(key) == spec]
        if len(exact) == 1:
            return exact[0]["NodeID"]
    prefixed = [n for n in nodes if spec and n["NodeID"].startswith(spec)]
    if len(prefixed) == 1:
        return prefixed[0]["NodeID"]
    by_address = [n for n in nodes if n.get("NodeManagerAddress") == spec]
    if len(by_address) == 1:
        return by_address[0]["NodeID"]
    names = ", ".join(f"{n.get('NodeName') or '?'} ({n['NodeID'][:12]}, {n.get('NodeManagerAddress')})" for n in nodes)
    raise ValueError(f"no single live Ray node matches {spec!r}; the live nodes are: {names or 'none'}")


def actor_nodes(run_id: str) -> dict[str, str]:
    """{actor name: node id} of the run's live named actors."""
    from ray._private import state

    names = set(run_actor_names().get(run_id, []))
    out = {}
    for info in state.actors().values():
        if info.get("Name") in names and info.get("RayNamespace", NAMESPACE) == NAMESPACE and info.get("State") == "ALIVE":
            out[info["Name"]] = info.get("Address", {}).get("NodeID", "")
    return out


def runs_on_node(node_id: str) -> list[str]:
    """The runs with an actor (or a pool bundle) on node `node_id`."""
    runs = set()
    for run_id in run_actor_names():
        if node_id in actor_nodes(run_id).values() or _pools_on(run_id, {node_id}):
            runs.add(run_id)
    return sorted(runs)


def _pools_on(run_id: str, node_ids: set[str]) -> list[str]:
    """The names of the run's placement groups with a bundle on one of `node_ids`."""
    from ray.util import placement_group_table

    out = []
    for name, group in run_pool_groups(run_id).items():
        bundles = placement_group_table(group).get("bundles_to_node_id", {})
        if set(bundles.values()) & node_ids:
            out.append(name)
    return out


def evacuate(actors: RunActors, node_ids: list[str]) -> list[str]:
    """Kill the run's actors on `node_ids` and remove its pools with a bundle there; returns
    the names of the actors that went. The caller saved what they hold first (a checkpoint)."""
    from ray.util import remove_placement_group

    run_id, wanted = actors.run_id, set(node_ids)
    placed = actor_nodes(run_id)
    going = {name for name, node in placed.items() if node in wanted}
    groups = run_pool_groups(run_id)
    pools = _pools_on(run_id, wanted)
    for name in pools:
        remove_placement_group(groups[name])
    # Every actor of a removed pool goes with it: the trainer ranks on a staying node too,
    # since a process group cannot lose a member and go on.
    going |= {name for name in placed if _pool_of(actors, name) in pools}
    kill_named(sorted(going))  # and wait until their names are free for the rebuilt ones
    if going or pools:
        log.warning(
            "run %s: moved off node(s) %s: released %s; pools %s are reserved again elsewhere",
            run_id, ", ".join(n[:12] for n in sorted(wanted)), ", ".join(sorted(going)) or "no actor", ", ".join(pools) or "none",
        )  # fmt: skip
    return sorted(going)


def _pool_of(actors: RunActors, name: str) -> str | None:
    """The placement-group name of the pool actor `name` (`<run>/<role>-<rank>`) is in."""
    role, _, rank = name.partition("/")[2].rpartition("-")
    slot = actors.plan.slot(role, int(rank)) if rank.isdigit() else None
    return pool_group_name(actors.run_id, slot.pool) if slot is not None else None
