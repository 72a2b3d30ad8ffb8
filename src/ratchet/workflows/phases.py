"""How the training workflow calls each kind of activity: one attempt's time limit,
whether it heartbeats, and the retry policy. Deterministic (imported inside the
workflow sandbox): temporalio's types and ratchet.errors only."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from temporalio.common import RetryPolicy

from ratchet.errors import NON_RETRYABLE

# Transient failures (a worker restarting, storage hiccups) are retried with backoff; an
# error that retrying cannot fix (bad config, lost trainer state) fails the run at once.
RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=5,
    non_retryable_error_types=list(NON_RETRYABLE),
)
# Activities heartbeat every second while they wait on Ray (activities/ray_calls.py); a
# worker process that died is noticed after `loop.heartbeat_timeout_s`, not after the
# whole timeout, and its activity is retried on another worker.


@dataclass
class Phase:
    """How one kind of activity is called: its timeout bounds a single attempt."""

    timeout: timedelta
    heartbeat: bool = True


PHASES = {
    "prepare_run": Phase(timedelta(minutes=2), heartbeat=False),
    "warmup": Phase(timedelta(minutes=30)),
    "start_workers": Phase(timedelta(minutes=10)),
    "generate": Phase(timedelta(minutes=30)),
    "score": Phase(timedelta(minutes=30)),
    "train": Phase(timedelta(minutes=30)),
    "sync_weights": Phase(timedelta(minutes=10)),
    # Sync mode's generate, score, train and sync in one activity (activities/training.py).
    "step": Phase(timedelta(minutes=60)),
    "evaluate": Phase(timedelta(minutes=30)),
    "checkpoint": Phase(timedelta(minutes=10)),
    "record_step": Phase(timedelta(minutes=1), heartbeat=False),
    "finish_run": Phase(timedelta(minutes=10)),
    # No heartbeat timeout: it runs after any failure, a bad `heartbeat_timeout_s` included.
    "release_run": Phase(timedelta(minutes=2), heartbeat=False),
    # `ratchet drain`: the run's actors leave a node that is about to go (after a checkpoint).
    "evacuate_nodes": Phase(timedelta(minutes=10)),
}
