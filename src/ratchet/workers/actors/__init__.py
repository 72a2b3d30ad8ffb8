"""The Ray actors of a run (trainer ranks, rollout, reward, critic) as worker-layer
objects: naming and release (names.py), placement and the CPU check (placement.py), the
run's actor groups kept at the expected policy version (run_actors.py), the rollout
replicas as one pool (rollout_pool.py), rebuilding lost state (recovery.py) one rebuilder at a time
(restore_lease.py), and the injected way of waiting on Ray (waiting.py). Nothing here
imports Temporal; failures are ratchet.errors domain errors."""

from .names import NAMESPACE, Role, run_actor_names
from .release import release_closed_runs, release_run_actors
from .run_actors import RunActors
from .waiting import PlainWaiter, Waiter, WaitTimeout

__all__ = [
    "NAMESPACE", "PlainWaiter", "Role", "RunActors", "WaitTimeout", "Waiter", "release_closed_runs", "release_run_actors",
    "run_actor_names",
]  # fmt: skip
