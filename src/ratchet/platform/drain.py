"""`ratchet drain NODE`: a Ray node is about to go (a spot reclaim notice, a Kubernetes
drain). Ray stops placing work on it, and every run with actors there is told to
checkpoint and move them off at its next step boundary (workers/actors/evacuation.py), so
a planned loss costs no replayed update. Run it from a machine that can join the Ray
cluster as a driver and reach Temporal; the node itself keeps running until whoever
reclaims it stops it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .client import Client


@dataclass
class DrainResult:
    node_id: str
    node_name: str
    runs: list[str] = field(default_factory=list)  # told to move off the node
    moved: bool = False  # with `wait`: no run has an actor there any more


def drain_node(client: Client, spec: str, *, deadline_s: float | None = None, wait_s: float = 0.0, on_wait=None) -> DrainResult:
    """Drain the live node `spec` (a Ray node name, node id or unique prefix, or address).
    Needs this process to be a driver of the cluster (`worker.connect_ray`). With `wait_s`,
    waits up to that long until no run has an actor or pool bundle on the node, calling
    `on_wait(runs still there)` as it goes."""
    import ray
    from ray.core.generated import autoscaler_pb2

    from ratchet.workers.actors.evacuation import alive_nodes, resolve_node, runs_on_node

    node_id = resolve_node(spec)
    deadline_ms = int((time.time() + deadline_s) * 1000) if deadline_s else 0
    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    accepted, why = gcs.drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"), "ratchet drain", deadline_ms
    )
    if not accepted:
        raise RuntimeError(f"Ray refused to drain node {spec} ({node_id[:12]}): {why}")
    runs = runs_on_node(node_id)
    for run_id in runs:
        client.get(run_id).drain(node_id)
    result = DrainResult(node_id, alive_nodes().get(node_id, spec), runs)
    end = time.monotonic() + wait_s
    while wait_s and time.monotonic() < end:
        left = runs_on_node(node_id)
        if not left:
            result.moved = True
            break
        if on_wait is not None:
            on_wait(left)
        time.sleep(1.0)
    return result
