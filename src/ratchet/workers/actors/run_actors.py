"""The Ray actors of one run as worker-layer objects: created once, found again by name,
rebuilt when lost, kept at the policy version the workflow expects.

The workflow owns the run state (docs/design.md, rule 4): a caller names the policy version it
expects, and a worker that was lost or holds another version is recreated and brought up
to date (from the trainer, or from the last checkpoint and the logged updates: recovery.py).
Failures are domain errors (ratchet.errors); the caller decides how to report them.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import ray

from functools import cached_property
from typing import TYPE_CHECKING

from ratchet.catalog.weight_transports import WEIGHT_TRANSPORTS
from ratchet.config.placement_plan import PlacementPlan, plan_placement
from ratchet.config.sync_transport import choose_transport
from ratchet.config.schema import RunConfig
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.layout import RunLayout

from ..results import EvalBatchResult, ScoreResult, TrainResult, WarmupResult
from ..weight_sync.ray_transport import published_sync
from ..weight_sync.transport import relayed_sync
from . import placement
from .names import Role, actor_name, find_named
from .release import release_run_actors
from .critic_group import CriticGroup
from .rollout_group import RolloutGroup
from .reward_group import RewardGroup
from .trainer_group import CheckpointTaken, TrainerGroup
from .waiting import PlainWaiter, Waiter

if TYPE_CHECKING:
    from ..weight_sync.protocol import SyncResult

log = logging.getLogger(__name__)


@dataclass
class RunActors:
    run_id: str
    run_uri: str
    cfg: RunConfig
    waiter: Waiter = field(default_factory=PlainWaiter)

    def wait(self, refs, *, timeout_s: float | None = None):
        return self.waiter.wait(refs, timeout_s=timeout_s)

    def name(self, role: str, rank: int = 0) -> str:
        return actor_name(self.run_id, role, rank)

    def find(self, role: str, rank: int = 0):
        """The live actor `role`-`rank` of this run, or None."""
        return find_named(self.name(role, rank))

    @cached_property
    def plan(self) -> PlacementPlan:
        """Which pool and bundle each actor takes (no pools: the whole cluster, as before)."""
        return plan_placement(self.cfg)

    @cached_property
    def trainer(self) -> TrainerGroup:
        """The trainer ranks (trainer_group.py)."""
        return TrainerGroup(self)

    @cached_property
    def rollout(self) -> RolloutGroup:
        """The rollout replicas (rollout_group.py)."""
        return RolloutGroup(self, self.trainer)

    @cached_property
    def reward(self) -> RewardGroup:
        """The reward worker (reward_group.py)."""
        return RewardGroup(self)

    @cached_property
    def critic(self) -> CriticGroup:
        """The critic of a GAE run (critic_group.py)."""
        return CriticGroup(self)

    def create(self, cls, role: str, rank: int, num_cpus: float, *args, concurrency: int = 1):
        """Actor `role`-`rank` of class `cls`, placed by the run's plan (placement.py)."""
        where = self.plan.slot(role, rank)
        slot = (where, next(p for p in self.plan.pools if p.name == where.pool)) if where is not None else None
        return placement.create_actor(
            self.run_id, self.cfg, self.waiter, cls, role, rank, num_cpus, *args, concurrency=concurrency, slot=slot,
        )  # fmt: skip

    def check_resources(self, settle_s: float = placement.RESOURCE_SETTLE_S) -> None:
        """ResourcesUnavailable at once when the CPUs the run needs are not free (with
        resource pools: reserve them, or refuse pools the cluster cannot hold)."""
        placement.check_resources(self.run_id, self.cfg, self.waiter, settle_s, plan=self.plan)

    def initial_policy(self) -> str:
        """The weights RL starts from: the warmed-up model if the run has a warm-up."""
        return ObjectStore(self.run_uri).uri(RunLayout.WARMUP_MODEL) if self.cfg.warmup.steps > 0 else self.cfg.model.path

    # -- the run's operations (the activities' calls) -------------------------------------

    def warm_up(self, base_model_path: str) -> WarmupResult:
        """The supervised warm-up (trainer rank 0). The reward worker needs only the
        tokenizer, which the warm-up leaves as it is: its process starts (and imports torch,
        seconds) meanwhile; `start` finds both by name."""
        self.reward.start(base_model_path)
        return self.trainer.warm_up(base_model_path)

    def start(self, policy_path: str) -> int:
        """Every actor of the run serving `policy_path`; returns the policy's parameter
        count. Every actor's process starts and imports torch (seconds each) at once: the
        rollout replicas, the reward worker and the critic are created first and load while
        the trainer ranks set up."""
        ready = [
            *(a.policy_version.remote() for a in self.rollout.start(policy_path)),
            self.reward.start(policy_path).__ray_ready__.remote(),
        ]
        if self.cfg.uses_critic:
            ready.append(self.critic.start().__ray_ready__.remote())
        n_params = self.trainer.start(policy_path)
        self.wait(ready)
        return n_params

    def restart_at(self, version: int) -> None:
        """A resume from a checkpoint: whatever actors the run still has released (its
        admission kept: no queued run takes their CPUs), the trainer (and critic) rebuilt at
        `version` from the checkpoint, the other actors made afresh."""
        self.shutdown(keep_admission=True)
        self.trainer.at_version(version)
        source = self.initial_policy()
        self.wait([*(a.policy_version.remote() for a in self.rollout.start(source)), self.reward.start(source).__ray_ready__.remote()])
        if self.cfg.uses_critic:
            self.critic.at_version(version)

    def train(
        self, batch_index: int, version: int, kl_coef: float, parts: int, *, live: dict | None, safe_lambda: float | None, retrying: bool
    ) -> TrainResult:  # fmt: skip
        """The policy update on stored batch `batch_index`; with a critic (GAE), its values
        first and its own update after (its metrics join the policy's). `retrying`: a
        retried attempt, whose first try may have made the update already."""
        critic = self.critic.at_version(version, retrying_update=retrying) if self.cfg.uses_critic else None
        if critic is not None:
            self.wait(critic.compute_values.remote(batch_index, parts))
        trained = self.trainer.update(batch_index, version, kl_coef, parts, live=live, safe_lambda=safe_lambda, retrying=retrying)
        if critic is None:
            return trained
        return dataclasses.replace(trained, metrics={**trained.metrics, **self.wait(critic.update.remote(batch_index, parts))})

    def evaluate(self, step: int, size: int, version: int) -> tuple[EvalBatchResult, ScoreResult]:
        """Greedy answers of rollout replica 0 (at `version` or newer) on the first `size`
        eval prompts, stored under `step`, and their scores."""
        generated = self.wait(self.rollout.replica(version).generate_eval.remote(step, size))
        return generated, self.reward.score(step, RunLayout.EVALS)  # eval batches are stored by training step

    def checkpoint(self, step: int, run_state: dict, version: int) -> CheckpointTaken:
        """Checkpoint `step` of policy v`version` (trainer_group.py), the critic's state in it."""
        critic_state = self.critic.state(version) if self.cfg.uses_critic else None
        return self.trainer.checkpoint(step, run_state, version, critic_state)

    def start_lost(self) -> None:
        """Start the rollout replicas and the reward worker that are gone, without waiting
        for them to be built: their processes import torch and load the model (seconds)
        while a lost trainer is rebuilt, instead of after it (a Ray restart or a lost
        node takes them all). Their next use finds them by name. Not colocated: a new
        engine would take device memory the trainer rebuilds in."""
        if self.plan.colocated:
            return
        self.rollout.start_lost()
        if self.find(Role.REWARD) is None:
            log.warning("run %s: the reward worker is gone; recreating it", self.run_id)
            self.reward.start(self.initial_policy())

    def sync_weights(self, version: int, *, ranks: list | None = None, targets: list | None = None) -> "SyncResult":
        """Trainer weights (v`version`, or newer when fully_async trains on meanwhile) -> every
        rollout replica, in buckets, by the transport the placement allows
        (config/sync_transport.py: Ray's object store, CUDA IPC when colocated on GPUs, NCCL
        when split on GPUs); returns what was moved, how, and the version synced.

        `ranks` and `targets`: the trainer ranks that just made update v`version` and every
        replica that just generated, from a caller that used them a moment ago (sync mode's
        step): looked up and probed once per step instead of twice. A replica lost since
        fails the load, and the step's retry looks them all up afresh."""
        # Every rollout replica, all to one version: the live ones, a lost one recreated
        # (colocated engines woken up); one replica: [rollout-0].
        if targets is None or self.plan.colocated:
            targets = self.rollout.replicas()
        if self.cfg.uses_partial_rollouts:
            # A sync overlapping the next update: the buckets rank 0 published after its
            # last one, read without queueing behind the update running now.
            rank0 = self.find(Role.TRAINER, 0)
            try:
                published = self.wait(rank0.published_weights.remote()) if rank0 is not None else None
            except ray.exceptions.RayError:
                published = None
            if published is not None and published[0] >= version:
                return published_sync(published, targets, self.wait)
        if ranks is None:
            ranks = self.trainer.at_version(version, at_least=True)
        transport = WEIGHT_TRANSPORTS.get(choose_transport(self.plan, self.cfg).value)
        return relayed_sync(transport, ranks, targets, self.wait, serving=transport.serving(self.plan, self.cfg, len(targets)))

    def shutdown(self, *, keep_admission: bool = False) -> list[str]:
        """Kill every actor of the run, whatever world size it had, and wait until their
        names (and so their CPUs) are free: the next run's check_resources counts on it.
        The run's admission grant goes too, unless `keep_admission` (a restore that
        rebuilds them at once: no queued run may take their CPUs in between)."""
        return release_run_actors(self.run_id, keep_admission=keep_admission)
