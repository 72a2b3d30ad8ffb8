"""Rebuilding lost trainer and critic state: the last good checkpoint at or before the
version the workflow expects, then the logged updates after it replayed on their stored
batches (the critic's on the stored values and returns).

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
from pathlib import Path

import ray
from temporalio import activity
from temporalio.exceptions import ApplicationError

from ratchet.errors import WORKER_LOST
from ratchet.storage import CheckpointStore, ObjectStore
from ratchet.workers.critic import CRITIC_META, CRITIC_STATE
from ratchet.workers.trainer import train_log_key

from .ray_calls import heartbeating, wait

log = logging.getLogger(__name__)


def _heartbeat(msg: str) -> None:
    """Progress of a long download: a checkpoint of a large model takes minutes to fetch."""
    if activity.in_activity():
        activity.heartbeat(msg)


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
    with tempfile.TemporaryDirectory(prefix="ratchet-restore-") as tmp:
        # A folder per try: a corrupted download's files must not mix with the next one's.
        # The heartbeats of `progress` come per file; `heartbeating` covers one long file.
        with heartbeating("downloading a checkpoint to restore the trainer"):
            found = checkpoints.newest_good(
                lambda info: checkpoints.download(info.name, Path(tmp) / info.name, progress=_heartbeat), max_step=expected_version
            )
        if found is not None:
            ckpt = found[0]
            version = wait([a.restore.remote(str(Path(tmp) / ckpt.name)) for a in ranks])[0]
            source = f"checkpoint {ckpt.name}"
    for entry, v in _logged_updates(pools, store, version, expected_version):
        # With the optimizer settings the update used (a resume may have changed them since).
        wait([a.train.remote(entry["batch"], v, entry["kl_coef"], entry["parts"], entry.get("optimizer")) for a in ranks])
    log.warning(
        "run %s: trainer rebuilt at v%d from %s and %d replayed updates in %.1f s",
        pools.run_id, expected_version, source, expected_version - version, time.perf_counter() - t0,
    )  # fmt: skip
    return ranks


def _logged_updates(pools, store: ObjectStore, start: int, end: int):
    """(train log entry, version) of the updates v`start` .. v`end - 1`, heartbeating."""
    for v in range(start, end):
        try:
            entry = store.get_json(train_log_key(v))
        except FileNotFoundError:
            raise ApplicationError(
                f"run {pools.run_id}: cannot rebuild the run's state: update v{v} was not logged ({train_log_key(v)} is missing)",
                type=WORKER_LOST,
                non_retryable=True,
            ) from None
        yield entry, v
        if activity.in_activity():
            activity.heartbeat(f"replayed update v{v}")


def restore_critic(pools, expected_version: int):
    """A fresh critic updated as often as policy v`expected_version`: the critic's files of
    the last good checkpoint at or before it (none: the initial critic), then the logged
    updates after it. Returns the actor."""
    t0 = time.perf_counter()
    old = pools._find("critic")
    if old is not None:
        ray.kill(old, no_restart=True)
        pools.wait_name_free(pools.name("critic"))
    critic = pools.start_critic()
    store = ObjectStore(pools.run_uri)
    checkpoints = CheckpointStore(store)
    version, source = 0, "the initial critic"
    # Checkpoints of a run without a critic (or from before critics were saved) hold none.
    with heartbeating("reading the critic's state to restore it"):
        found = checkpoints.newest_good(
            lambda info: checkpoints.read_files(info.name, [CRITIC_STATE, CRITIC_META]) if CRITIC_STATE in info.files else None,
            max_step=expected_version,
        )
    if found is not None and found[1] is not None:
        version = wait(critic.load_state_files.remote(found[1]))
        source = f"checkpoint {found[0].name}"
    for entry, _ in _logged_updates(pools, store, version, expected_version):
        wait(critic.update.remote(entry["batch"], entry["parts"]))
    log.warning(
        "run %s: critic rebuilt at v%d from %s and %d replayed updates in %.1f s",
        pools.run_id, expected_version, source, expected_version - version, time.perf_counter() - t0,
    )  # fmt: skip
    return critic
