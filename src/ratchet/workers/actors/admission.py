"""Admitting runs to the Ray cluster whole, first come first served.

A run needs all its actors at once (the trainer waits for the rollout, the rollout for
the trainer). Reserving them one actor at a time let two runs on a 2-CPU cluster take
one CPU each and wait forever for the second. So a run is *admitted* before it reserves
anything (before its warm-up): it gets a grant for everything it needs (its CPUs and
GPUs: `placement.run_need`), or it waits in a FIFO queue that says where it stands
(`waiting for 2 CPUs; 1 run ahead`). The grant is held until the run's actors are
released (`release.release_run_actors`: completion, failure, cancellation, the sweep of
closed runs).

Why a ledger, not one Ray placement group per run holding every actor: a placement group
is reserved atomically and Ray queues pending ones, but it pins each bundle to a node, and
the run then could not follow what already works without it: a drained node's actors are
rebuilt *elsewhere* (evacuation.py), a run with `resources.pools` holds one group per pool
(two groups reserved one after the other deadlock just like two actors), and Ray's
pending-group order is not a queue a user can be shown. The ledger is a tiny detached
actor (`admission-ledger`, 0 CPUs, on the head node, like the run's restore leases:
restore_lease.py) that only does the arithmetic; actors and pools are placed as before.

- *Whole and FIFO*: the head of the queue is granted when the cluster's total CPUs and GPUs
  cover every grant plus its need, *and* Ray has them free now (less what the run's own
  live actors hold): CPUs held outside the queue (another Ray job, leftovers being swept)
  keep it waiting instead of failing its placement. Nobody overtakes the head: a big run
  is not starved by small ones. Runs that fit together are all granted at once.
- *A rebuilt actor keeps its CPUs*: a killed actor's run still holds its grant, so a
  queued run is not admitted into the CPUs in between (`reclaim` re-registers a run that
  creates actors without a grant the ledger knows of).
- *A queued run that went away* loses its place: an entry not renewed within `LEASE_S`
  (its activity is gone: a terminated run, a dead worker) is dropped. Stop and cancel
  leave the queue at once (the activity is cancelled: `leave`).
- *Lost with the Ray head*: the next caller makes a new ledger. Queued runs come back
  with the time they first queued (`queued_at`, kept by the workflow), so the order
  survives; running runs re-register as they rebuild their actors (`reclaim`, never
  refused). A queued run coming back to a new ledger shows it was rebuilt: until
  `REBUILT_HOLD_S` after its creation nobody is admitted, so that the running runs get
  their CPUs back first.

Nodes that die shrink the total: the grants stand (their runs wait for their actors'
placement, as before), and the queue waits until the grants fit again.
"""

from __future__ import annotations

import logging
import time

import ray

from ..admission_ledger import LEASE_S, REBUILT_HOLD_S, Admission, AdmissionLedger, Need
from .names import NAMESPACE

log = logging.getLogger(__name__)

LEDGER_NAME = "admission-ledger"  # no '/': never taken for a run's actor (names.run_actor_names)
_HEAD_NODE = {"node:__internal_head__": 0.001}  # pinned to the head: lost only with it

__all__ = [
    "LEASE_S", "LEDGER_NAME", "REBUILT_HOLD_S", "Admission", "AdmissionLedger", "Need", "granted", "leave", "ledger_runs",
    "queue", "reclaim", "request",
]  # fmt: skip


# -- the ledger as a detached Ray actor, from any process -------------------------------


def _ledger(create: bool = True):
    try:
        return ray.get_actor(LEDGER_NAME, namespace=NAMESPACE)
    except ValueError:
        if not create:
            return None
    return (
        ray.remote(AdmissionLedger)
        .options(
            name=LEDGER_NAME,
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            resources=_HEAD_NODE,
            scheduling_strategy="DEFAULT",
        )  # fmt: skip
        .remote()
    )


def _call(method: str, *args, create: bool = True, timeout_s: float = 60.0):
    """`method` on the ledger (made if missing and `create`); one that died (its node
    went) is made again. None when there is none and `create` is False."""
    for attempt in range(5):
        ledger = _ledger(create)
        if ledger is None:
            return None
        try:
            return ray.get(getattr(ledger, method).remote(*args), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            log.warning("the admission ledger was lost; making a new one")
            time.sleep(0.2 * (attempt + 1))  # its name is freed a moment after it died
    raise RuntimeError("the admission ledger keeps dying; is the Ray head node healthy?")


def request(run_id: str, need: Need, queued_at: float = 0.0, held: Need | None = None) -> Admission:
    """Admit the run now, or keep its place in the queue (renewed for LEASE_S)."""
    return _call("request", run_id, need, queued_at, held)


def reclaim(run_id: str, need: Need) -> None:
    """Hold the run's grant before creating an actor (see AdmissionLedger.reclaim)."""
    if _call("reclaim", run_id, need):
        log.info("run %s: re-registered its grant of %s with the admission ledger", run_id, need.text())


def leave(run_id: str) -> bool:
    """Release the run's grant or its place in the queue (no ledger: nothing to do)."""
    return bool(_call("leave", run_id, create=False))


def granted() -> dict[str, Need]:
    return _call("granted", create=False) or {}


def queue() -> list[tuple[str, Need, float]]:
    return _call("queue", create=False) or []


def ledger_runs() -> list[str]:
    """Every run that holds a grant or a place in the queue."""
    return sorted(set(granted()) | {run_id for run_id, _, _ in queue()})
