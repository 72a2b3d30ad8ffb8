"""The run's critic (GAE runs) as a group of one: made, found updated as often as the policy
the workflow expects (lost or out of step, rebuilt from the last checkpoint and the logged
updates: recovery.py), and its state for a checkpoint. The step's values and the
critic's own update are `RunActors.train`'s."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..critic import CriticWorker
from .names import Role
from . import recovery
from .versions import found_or_rebuilt, holds_version

if TYPE_CHECKING:
    from .run_context import RunContext

log = logging.getLogger(__name__)


@dataclass
class CriticGroup:
    actors: "RunContext"

    def start(self):
        cfg = self.actors.cfg
        return self.actors.create(CriticWorker, Role.CRITIC, 0, cfg.resources.critic_cpus, cfg, self.actors.run_uri)

    def at_version(self, expected_version: int, *, retrying_update: bool = False):
        """The critic, updated as often as policy v`expected_version` was (or once more, for
        a retried update whose first try got that far)."""
        return found_or_rebuilt(
            self.actors.run_id, Role.CRITIC, self.actors.waiter, self.actors.find(Role.CRITIC), lambda: self.actors.find(Role.CRITIC),
            lambda actor, first: self._holds(actor, expected_version, retrying_update, log_mismatch=first),
            lambda: recovery.restore_critic(self.actors, self, expected_version),
        )  # fmt: skip

    def _holds(self, actor, expected_version: int, retrying_update: bool, *, log_mismatch: bool = False) -> bool:
        if actor is None:
            if log_mismatch:
                log.warning("run %s: the critic is gone; restoring it", self.actors.run_id)
            return False
        return holds_version(
            self.actors.waiter, self.actors.run_id, actor, "the critic", expected_version,
            retrying_update=retrying_update, log_mismatch=log_mismatch,
        )  # fmt: skip

    def state(self, version: int):
        """The critic's files for a checkpoint of policy v`version`, as an ObjectRef that
        trainer rank 0 takes straight from the critic (the bytes never pass through here)."""
        return self.at_version(version).state_files.remote()
