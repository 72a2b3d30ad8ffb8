"""Rebuilding lost trainer and critic state: the last good checkpoint at or before the
version the workflow expects, then the logged updates after it replayed on their stored
batches (the critic's on the stored values and returns).

Every update is logged (`train_log/v<version>.json`) and every batch stays in the batch
store, so this needs no help from the workflow: the result is the trainer the workflow
believes in (docs/design.md, rule 4). Updates are deterministic given their inputs on CPU, so
the rebuilt weights equal the lost ones bit for bit (`deterministic: true` makes the
kernels so everywhere).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from ratchet.errors import WorkerLost
from ratchet.storage.checkpoint_store import CheckpointStore, CorruptCheckpoint
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.layout import RunLayout

from .names import Role, kill_named

if TYPE_CHECKING:
    from .run_context import RunContext

log = logging.getLogger(__name__)


class TrainerRanks(Protocol):
    """The trainer group as a rebuild uses it (trainer_group.py)."""

    def kill(self) -> None: ...

    def start(self, policy_path: str) -> int: ...

    def ranks(self) -> list: ...


class CriticActor(Protocol):
    """The critic group as a rebuild uses it (critic_group.py)."""

    def start(self) -> Any: ...


def restore_trainers(actors: RunContext, trainer: TrainerRanks, expected_version: int) -> list:
    """Fresh trainer ranks holding policy v`expected_version`; returns them. The ranks
    fetch the checkpoint from the object store themselves, each onto its own node
    (`TrainerWorker.restore_from_store`): nothing is downloaded here, and no rank reads a
    path on this process's host."""
    t0 = time.perf_counter()
    trainer.kill()  # a survivor of a broken process group cannot rejoin it
    trainer.start(actors.initial_policy())
    ranks = trainer.ranks()
    store = ObjectStore(actors.run_uri)
    checkpoints = CheckpointStore(store)
    version, source = 0, "the initial policy"

    def load(info) -> int:
        # Every rank downloads and verifies its copy; a file that does not match the
        # manifest on any rank: no rank loaded, and the one before it is tried.
        outs = actors.wait([a.restore_from_store.remote(info.name) for a in ranks])
        if outs[0].problems:
            raise CorruptCheckpoint(info.name, list(outs[0].problems))
        actors.waiter.progress(f"trainer ranks restored checkpoint {info.name}")
        return outs[0].version

    # Checkpoints are named by step, and every step is one update: step == version.
    # The waits heartbeat; `busy` also covers reading the manifests.
    with actors.waiter.busy("the trainer ranks are fetching a checkpoint from the object store to restore it"):
        found = checkpoints.newest_good(load, max_step=expected_version)
    if found is not None:
        version, source = found[1], f"checkpoint {found[0].name}"
    for entry, v in _logged_updates(actors, store, version, expected_version):
        # With the optimizer settings and live values the update used (a resume or a live
        # change may have changed them since); the next update gets the values in force.
        hyper, live = entry.get("optimizer"), entry.get("live")
        safe_lambda = entry.get("safe_lambda")  # Safe-RLHF's multiplier, logged by runs that use it
        actors.wait(
            [a.train.remote(entry["batch"], v, entry["kl_coef"], entry["parts"], hyper, live=live, safe_lambda=safe_lambda) for a in ranks]
        )
    log.warning(
        "run %s: trainer rebuilt at v%d from %s and %d replayed updates in %.1f s",
        actors.run_id, expected_version, source, expected_version - version, time.perf_counter() - t0,
    )  # fmt: skip
    return ranks


def _logged_updates(actors: RunContext, store: ObjectStore, start: int, end: int):
    """(train log entry, version) of the updates v`start` .. v`end - 1`, reporting progress."""
    for v in range(start, end):
        try:
            entry = store.get_json(RunLayout.train_log(v))
        except FileNotFoundError:
            raise WorkerLost(
                f"run {actors.run_id}: cannot rebuild the run's state: update v{v} was not logged ({RunLayout.train_log(v)} is missing)"
            ) from None
        yield entry, v
        actors.waiter.progress(f"replayed update v{v}")


def restore_critic(actors: RunContext, critic_group: CriticActor, expected_version: int):
    """A fresh critic updated as often as policy v`expected_version`: the critic's files of
    the last good checkpoint at or before it (none: the initial critic), then the logged
    updates after it. Returns the actor."""
    t0 = time.perf_counter()
    kill_named([actors.name(Role.CRITIC)])
    critic = critic_group.start()
    store = ObjectStore(actors.run_uri)
    checkpoints = CheckpointStore(store)
    version, source = 0, "the initial critic"
    # Checkpoints of a run without a critic (or from before critics were saved) hold none.
    with actors.waiter.busy("reading the critic's state to restore it"):
        found = checkpoints.newest_good(
            lambda info: (
                checkpoints.read_files(info.name, [RunLayout.CRITIC_STATE, RunLayout.CRITIC_META])
                if RunLayout.CRITIC_STATE in info.files
                else None
            ),
            max_step=expected_version,
        )
    if found is not None and found[1] is not None:
        version = actors.wait(critic.load_state_files.remote(found[1]))
        source = f"checkpoint {found[0].name}"
    for entry, _ in _logged_updates(actors, store, version, expected_version):
        actors.wait(critic.update.remote(entry["batch"], entry["parts"]))
    log.warning(
        "run %s: critic rebuilt at v%d from %s and %d replayed updates in %.1f s",
        actors.run_id, expected_version, source, expected_version - version, time.perf_counter() - t0,
    )  # fmt: skip
    return critic
