"""The Ray actors of a run (trainer ranks, rollout, reward, critic) as worker-layer
objects: naming and release (names.py), placement and the CPU check (placement.py), the
run's actors and the operations asked of them (run_actors.py), its groups kept at the
expected policy version (trainer_group.py, reward_group.py, critic_group.py; the rollout
replicas as one pool: rollout_pool.py), sync mode's whole step in memory (fused_step.py),
rebuilding lost state (recovery.py) one rebuilder at a time (restore_lease.py), and the
injected way of waiting on Ray (waiting.py). Nothing here imports Temporal; failures are
ratchet.errors domain errors; no ObjectRef or actor handle is handed to a caller outside."""

from .names import NAMESPACE, Role, run_actor_names
from .release import release_closed_runs, release_run_actors
from .run_actors import RunActors
from .waiting import PlainWaiter, Waiter, WaitTimeout

__all__ = [
    "NAMESPACE", "PlainWaiter", "Role", "RunActors", "WaitTimeout", "Waiter", "release_closed_runs", "release_run_actors",
    "run_actor_names",
]  # fmt: skip
