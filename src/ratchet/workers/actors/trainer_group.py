"""The run's trainer ranks as one group: made and set up together (a process group of
`trainer.world_size`), found at the policy version the workflow expects (lost or out of
step, rebuilt from the last checkpoint and the logged updates: recovery.py), and the
operations asked of them (an update, a checkpoint, the export), typed: no caller outside
the worker layer sees a rank's handle or an ObjectRef.

A retried update is safe to send again: a rank that already made it answers from its
retry cache (TrainerWorker.train). Checkpoints are written in the background by every rank
and committed by rank 0 (workers/trainer.py); a failed background upload is reported by
the next checkpoint, which is then taken in the foreground.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray

from ratchet.errors import CheckpointFailed

from ..results import CheckpointOutcome, CheckpointStarted, TrainResult, WarmupResult
from ..trainer import TrainerWorker
from .names import Role, kill_named, run_actor_names
from . import recovery
from .versions import found_or_rebuilt, holds_version
from .waiting import WaitTimeout

if TYPE_CHECKING:
    from .run_context import RunContext

log = logging.getLogger(__name__)

# How long a trainer rank that survived an earlier start may take to answer.
PROBE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class TrainerProbe:
    """The live ranks and rank 0's version asked ahead (`TrainerGroup.probe`)."""

    ranks: list
    version: object  # the ObjectRef of rank 0's answer; None when a rank is missing


@dataclass(frozen=True)
class CheckpointTaken:
    """A checkpoint started on every rank (committed in the background)."""

    name: str
    stall_seconds: float  # the longest a rank's training stalled for the snapshot
    waited_seconds: float  # the longest a rank waited for its previous upload


@dataclass
class TrainerGroup:
    actors: "RunContext"

    # -- creation and health --------------------------------------------------------------

    def _create(self, rank: int, policy_path: str):
        cfg = self.actors.cfg
        return self.actors.create(
            TrainerWorker, Role.TRAINER, rank, cfg.resources.trainer_cpus, cfg, policy_path, self.actors.run_uri, rank, cfg.trainer.world_size,
        )  # fmt: skip

    def warm_up(self, base_model_path: str) -> WarmupResult:
        """The supervised warm-up, run by rank 0 before it sets up: the process that trains
        next does it, so it costs no process of its own. Rank 0 is made with the warm-up
        model as its policy (`RunActors.initial_policy`); `start` sets it up."""
        rank0 = self._create(0, self.actors.initial_policy())
        return self.actors.wait(rank0.warm_up.remote(base_model_path))

    def start(self, policy_path: str) -> int:
        """Create and set up every rank; returns the parameter count. Idempotent: a retried
        start reuses ranks that are all set up, and ranks never set up for this policy
        (rank 0 after the warm-up) are set up as they are; ranks left half set up (a process
        group that may be broken) are killed and all ranks made afresh, since a surviving
        rank cannot join a new group."""
        world = self.actors.cfg.trainer.world_size
        survivors = self.ranks()
        if any(a is not None for a in survivors):
            count = self._set_up_count(survivors)
            if count is not None:
                log.info("run %s: trainer ranks already set up; reusing them", self.actors.run_id)
                return count
            if not self._never_set_up(survivors, policy_path):
                log.warning("run %s: trainer ranks half set up; recreating all %d", self.actors.run_id, world)
                self.kill()
                survivors = [None] * world
        ranks = [a if a is not None else self._create(r, policy_path) for r, a in enumerate(survivors)]
        # Rank 0's node address and a port free there: the ranks may be on several nodes.
        host, port = self.actors.wait(ranks[0].rendezvous_address.remote())
        counts = self.actors.wait([a.setup.remote(port, host) for a in ranks])
        return counts[0]

    def _set_up_count(self, ranks: list) -> int | None:
        """The parameter count if every rank exists and is set up (in one group), else None."""
        if any(a is None for a in ranks):
            return None
        try:
            infos = self.actors.wait([a.setup_info.remote() for a in ranks], timeout_s=PROBE_TIMEOUT_S)
        except (WaitTimeout, ray.exceptions.RayError):
            return None  # busy (stuck in a collective) or dead
        if all(i.ready and i.world_size == len(ranks) for i in infos):
            return infos[0].num_parameters
        return None

    def _never_set_up(self, ranks: list, policy_path: str) -> bool:
        """Whether every live rank among `ranks` is fresh: made for `policy_path`, never set
        up, in no process group (rank 0 after the warm-up); such ranks can still join one."""
        live = [a for a in ranks if a is not None]
        try:
            infos = self.actors.wait([a.setup_info.remote() for a in live], timeout_s=PROBE_TIMEOUT_S)
        except (WaitTimeout, ray.exceptions.RayError):
            return False
        world = self.actors.cfg.trainer.world_size
        return all(not i.ready and i.process_group_inits == 0 and i.world_size == world and i.policy_uri == policy_path for i in infos)

    def ranks(self) -> list:
        """The live ranks (None for a missing one), without any version check."""
        return [self.actors.find(Role.TRAINER, r) for r in range(self.actors.cfg.trainer.world_size)]

    def probe(self) -> TrainerProbe:
        """Rank 0's version asked ahead, for `at_version(..., probe=)`: its round trip
        overlaps whatever the caller does meanwhile (the step's generation)."""
        ranks = self.ranks()
        return TrainerProbe(ranks, ranks[0].policy_version.remote() if all(a is not None for a in ranks) else None)

    def at_version(
        self, expected_version: int, *, retrying_update: bool = False, at_least: bool = False, probe: TrainerProbe | None = None
    ) -> list:  # fmt: skip
        """The ranks, holding `expected_version` (or, for a retried update whose first try
        already made it, the version after it; with `at_least`, any newer one). Ranks that
        were lost or hold another version are rebuilt from the last checkpoint and the
        logged updates after it (recovery.py). `probe`: what `probe` asked earlier."""
        ranks, held = (probe.ranks, probe.version) if probe is not None else (self.ranks(), None)
        return found_or_rebuilt(
            self.actors.run_id, Role.TRAINER, self.actors.waiter, ranks, self.ranks,
            lambda found, first: self._hold(found, expected_version, retrying_update, at_least, log_mismatch=first, held=held if first else None),
            lambda: recovery.restore_trainers(self.actors, self, expected_version),
        )  # fmt: skip

    def _hold(
        self, ranks: list, expected_version: int, retrying_update: bool, at_least: bool, *, log_mismatch: bool = False, held=None
    ) -> bool:
        if any(a is None for a in ranks):
            if log_mismatch:
                log.warning("run %s: a trainer rank is gone; restoring it", self.actors.run_id)
            return False
        return holds_version(
            self.actors.waiter, self.actors.run_id, ranks[0], "the trainer", expected_version,
            retrying_update=retrying_update, at_least=at_least, log_mismatch=log_mismatch, held=held,
        )  # fmt: skip

    def version(self, ranks: list) -> int:
        """Rank 0's version now (of ranks from `at_version`)."""
        return self.actors.wait(ranks[0].policy_version.remote())

    def kill(self) -> None:
        """Every rank of the run, whatever world size it was started with."""
        prefix = self.actors.name(Role.TRAINER, 0)[:-1]
        kill_named([n for n in run_actor_names().get(self.actors.run_id, []) if n.startswith(prefix)])

    # -- operations ------------------------------------------------------------------------

    def update(
        self, batch_index: int, version: int, kl_coef: float, parts: int, *, live: dict | None, safe_lambda: float | None,
        retrying: bool,
    ) -> TrainResult:  # fmt: skip
        """Policy v`version` updated on stored batch `batch_index` (`parts` rollout parts) by
        every rank; rank 0's result. `live`: hyper-parameters set while the run trains
        (live_keys.py), for this update."""
        ranks = self.at_version(version, retrying_update=retrying)
        outs = self.actors.wait([a.train.remote(batch_index, version, kl_coef, parts, live=live, safe_lambda=safe_lambda) for a in ranks])
        return outs[0]

    def checkpoint(self, step: int, run_state: dict, version: int, critic_state=None) -> CheckpointTaken:
        """Snapshot the state of policy v`version` as checkpoint `step`, with `run_state` (and
        the critic's files, `critic_state`: handed to rank 0 by Ray, not through here); the
        ranks write, export and upload it in the background. A background upload that
        failed is reported now, never dropped: this checkpoint is then taken in the
        foreground, and CheckpointFailed is raised if it fails too."""
        ranks = self.at_version(version)
        failed = _errors(self.actors.wait([a.wait_checkpoint.remote() for a in ranks]))
        if failed:
            log.warning("run %s: %s; taking checkpoint step %d in the foreground", self.actors.run_id, failed, step)
        outs = self.actors.wait(
            [a.start_checkpoint.remote(step, run_state, critic_state if r == 0 else None, bool(failed)) for r, a in enumerate(ranks)]
        )
        now_failed = _errors(outs)
        if now_failed:
            earlier = f" (after an earlier one: {failed})" if failed else ""
            raise CheckpointFailed(f"run {self.actors.run_id}: {now_failed}{earlier}")
        return CheckpointTaken(
            name=outs[0].name, stall_seconds=max(o.stall_seconds for o in outs), waited_seconds=max(o.waited_seconds for o in outs)
        )

    def settle_last_checkpoint(self, ranks: list | None = None) -> None:
        """A run must not complete without its last checkpoint: if it failed, take it again
        (the trainer still holds its version unless it trained on); if that fails too,
        raise CheckpointFailed: Temporal retries the attempt, and then the run fails naming
        the checkpoint. `ranks`: the live ranks (default: as found now; with a rank gone
        there is nothing to settle: its uploads went with it)."""
        ranks = self.ranks() if ranks is None else ranks
        if any(a is None for a in ranks):
            return
        failed = _errors(self.actors.wait([a.wait_checkpoint.remote() for a in ranks]))
        if not failed:
            return
        log.warning("run %s: %s; taking it again", self.actors.run_id, failed)
        outs = self.actors.wait([a.redo_checkpoint.remote() for a in ranks])
        again = _errors(outs)
        if again:
            # A retry cannot help once the trainer trained on: the failed state is gone.
            raise CheckpointFailed(
                f"run {self.actors.run_id}: {again}. The run has no committed checkpoint of its last state; check storage.root "
                "(space, permissions, the object store) and resume the run from its last good checkpoint",
                non_retryable=any(o.impossible for o in outs),
            )

    def finish(self, version: int, export_key: str | None) -> str:
        """The run's last checkpoint committed (`settle_last_checkpoint`), then policy
        v`version` exported under `export_key` (None: not exported); the export's address or ""."""
        ranks = self.at_version(version)
        self.settle_last_checkpoint(ranks)  # the last upload lands first
        if export_key is None:
            return ""
        return self.actors.wait([a.export.remote(export_key) for a in ranks])[0]


def _errors(outs: list[CheckpointStarted | CheckpointOutcome]) -> str:
    """The failures the ranks report (every rank writes and uploads its own files; rank 0
    commits), as one text."""
    return "; ".join(dict.fromkeys(o.error for o in outs if o.error))
