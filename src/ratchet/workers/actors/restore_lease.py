"""One rebuild of a run's trainer (or critic) at a time, across every activity and process.

Activities of one run overlap: in fully_async a weight sync runs beside the next update,
and a checkpoint beside that sync. When a trainer rank dies, each of them finds it gone
and would rebuild it, and a rebuild starts by killing the ranks it finds (a survivor of a
broken process group cannot rejoin one). Two rebuilders then kill each other's half-built
ranks in turn until both run out of retries. So a rebuild first takes the run's lease of
that role: a tiny detached actor, because the rebuilders may run in different Temporal
worker processes or on different nodes. Whoever waited for the lease looks again before
rebuilding: usually the other rebuild already made what it needs.

The lease expires unless renewed, so a holder that died mid-rebuild (its process or its
node) blocks the others for `LEASE_S` at most. Losing the lease actor itself (its node
died) only loses the exclusion for that moment; the next caller makes a new one. The
actor's class is in workers/rebuild_lease.py, outside this package (see there why).
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator

import ray

from ratchet.workers.rebuild_lease import RestoreLease

from .names import NAMESPACE, actor_name
from .waiting import Waiter

# How long a lease lasts without renewal; the holder renews it every third of that.
LEASE_S = 30.0
_POLL_S = 0.25


def lease_name(run_id: str, role: str) -> str:
    """`<run>/restore_<role>-0`: released with the run's other actors (names.py)."""
    return actor_name(run_id, f"restore_{role}")


def _lease_actor(run_id: str, role: str):
    return (
        ray.remote(RestoreLease)
        .options(name=lease_name(run_id, role), namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0)
        .remote()
    )


@contextlib.contextmanager
def restore_lease(run_id: str, role: str, waiter: Waiter, *, lease_s: float = LEASE_S) -> Iterator[None]:
    """Hold run `run_id`'s lease to rebuild `role` while the body runs; waits (reporting
    progress, so an activity keeps heartbeating) while another caller holds it."""
    me = uuid.uuid4().hex
    lease = _lease_actor(run_id, role)
    while True:
        try:
            if ray.get(lease.acquire.remote(me, lease_s)):
                break
        except ray.exceptions.RayActorError:
            lease = _lease_actor(run_id, role)  # its node died, or it was released: a new one
            continue
        waiter.progress(f"waiting while another activity rebuilds the run's {role}")
        time.sleep(_POLL_S)
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(lease_s / 3):
            try:
                ray.get(lease.acquire.remote(me, lease_s))
            except ray.exceptions.RayError:
                return

    renewer = threading.Thread(target=renew, name=f"restore-lease-{role}", daemon=True)
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join()
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(lease.release.remote(me))
