"""Rebuilding lost trainer state: the last good checkpoint at or before the version the
workflow expects, then the logged updates after it replayed on their stored batches.

Every update is logged (`train_log/v<version>.json`) and every batch stays in the batch
store, so this needs no help from the workflow: the result is the trainer the workflow
believes in (DESIGN.md, rule 4). Updates are deterministic given their inputs on CPU, so
the rebuilt weights equal the lost ones bit for bit (`deterministic: true` makes the
kernels so everywhere).
"""

from __future__ import annotations

import logging
import tempfile
import time

from temporalio import activity
from temporalio.exceptions import ApplicationError

from ratchet.storage import CheckpointStore, ObjectStore
from ratchet.workers.trainer import train_log_key

from .ray_calls import wait

log = logging.getLogger(__name__)


def restore_trainers(pools, expected_version: int) -> list:
    """Fresh trainer ranks holding policy v`expected_version`; returns them."""
    t0 = time.perf_counter()
    pools.kill_trainers()  # a survivor of a broken process group cannot rejoin it
    pools.start_trainers(pools.initial_policy())
    ranks = [pools._find("trainer", r) for r in range(pools.cfg.trainer.world_size)]
    store = ObjectStore(pools.run_uri)
    checkpoints = CheckpointStore(store)
    version, source = 0, "the initial policy"
    # Checkpoints are named by step, and every step is one update: step == version.
    ckpt = checkpoints.latest(max_step=expected_version)
    if ckpt is not None:
        with tempfile.TemporaryDirectory(prefix="ratchet-restore-") as tmp:
            checkpoints.download(ckpt.name, tmp)
            version = wait([a.restore.remote(tmp) for a in ranks])[0]
        source = f"checkpoint {ckpt.name}"
    for v in range(version, expected_version):
        try:
            entry = store.get_json(train_log_key(v))
        except FileNotFoundError:
            raise ApplicationError(
                f"run {pools.run_id}: cannot rebuild the trainer: update v{v} was not logged ({train_log_key(v)} is missing)",
                type="WorkerLost",
                non_retryable=True,
            ) from None
        wait([a.train.remote(entry["batch"], v, entry["kl_coef"], entry["parts"]) for a in ranks])
        if activity.in_activity():
            activity.heartbeat(f"replayed update v{v}")
    log.warning(
        "run %s: trainer rebuilt at v%d from %s and %d replayed updates in %.1f s",
        pools.run_id, expected_version, source, expected_version - version, time.perf_counter() - t0,
    )  # fmt: skip
    return ranks
