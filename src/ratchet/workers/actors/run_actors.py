"""The Ray actors of one run as worker-layer objects: created once, found again by name,
rebuilt when lost, kept at the policy version the workflow expects.

The workflow owns the run state (docs/design.md, rule 4): a caller names the policy version it
expects, and a worker that was lost or holds another version is recreated and brought up
to date (from the trainer, or from the last checkpoint and the logged updates: recovery.py).
Failures are domain errors (ratchet.errors); the caller decides how to report them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import ray

from functools import cached_property
from typing import TYPE_CHECKING

from ratchet.catalog.weight_transports import WEIGHT_TRANSPORTS
from ratchet.config.placement_plan import PlacementPlan, plan_placement
from ratchet.config.sync_transport import choose_transport
from ratchet.config.schema import RunConfig
from ratchet.errors import RewardTimeout, WorkerLost
from ratchet.storage import ObjectStore, RunLayout

from ..critic import CriticWorker
from ..results import GenerateResult, ScoreResult, WarmupResult
from ..reward import RewardWorker
from ..rollout import RolloutWorker
from ..trainer import TrainerWorker
from ..weight_sync.ray_transport import published_sync
from ..weight_sync.transport import relayed_sync
from . import placement
from .names import Role, actor_name, find_named, kill_named, run_actor_names
from .release import release_run_actors
from .restore_lease import restore_lease
from .waiting import PlainWaiter, Waiter, WaitTimeout

if TYPE_CHECKING:
    from ..weight_sync.protocol import SyncResult

log = logging.getLogger(__name__)

# How long a trainer rank that survived an earlier start may take to answer.
PROBE_TIMEOUT_S = 10.0
# Actors (by id) this process saw constructed: a step's path skips asking them again.
_CONSTRUCTED: set[str] = set()


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

    def _create(self, cls, role: str, rank: int, num_cpus: float, *args, concurrency: int = 1):
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

    # -- trainer -------------------------------------------------------------------------

    def _create_trainer(self, rank: int, policy_path: str):
        world = self.cfg.trainer.world_size
        return self._create(
            TrainerWorker, Role.TRAINER, rank, self.cfg.resources.trainer_cpus, self.cfg, policy_path, self.run_uri, rank, world,
        )  # fmt: skip

    def warm_up(self, base_model_path: str) -> WarmupResult:
        """The supervised warm-up, run by trainer rank 0 before it sets up: the process that
        trains next does it, so it costs no process of its own. Rank 0 is made with the
        warm-up model as its policy (`initial_policy`); `start_trainers` sets it up."""
        rank0 = self._create_trainer(0, self.initial_policy())
        return self.wait(rank0.warm_up.remote(base_model_path))

    def start_trainers(self, policy_path: str) -> int:
        """Create and set up every trainer rank; returns the parameter count. Idempotent: a
        retried start reuses ranks that are all set up, and ranks never set up for this
        policy (rank 0 after the warm-up) are set up as they are; ranks left half set up (a
        process group that may be broken) are killed and all ranks made afresh, since a
        surviving rank cannot join a new group."""
        world = self.cfg.trainer.world_size
        survivors = [self.find(Role.TRAINER, r) for r in range(world)]
        if any(a is not None for a in survivors):
            count = self._set_up_count(survivors)
            if count is not None:
                log.info("run %s: trainer ranks already set up; reusing them", self.run_id)
                return count
            if not self._never_set_up(survivors, policy_path):
                log.warning("run %s: trainer ranks half set up; recreating all %d", self.run_id, world)
                self.kill_trainers()
                survivors = [None] * world
        ranks = [a if a is not None else self._create_trainer(r, policy_path) for r, a in enumerate(survivors)]
        # Rank 0's node address and a port free there: the ranks may be on several nodes.
        host, port = self.wait(ranks[0].rendezvous_address.remote())
        counts = self.wait([a.setup.remote(port, host) for a in ranks])
        return counts[0]

    def _set_up_count(self, ranks: list) -> int | None:
        """The parameter count if every rank exists and is set up (in one group), else None."""
        if any(a is None for a in ranks):
            return None
        try:
            infos = self.wait([a.setup_info.remote() for a in ranks], timeout_s=PROBE_TIMEOUT_S)
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
            infos = self.wait([a.setup_info.remote() for a in live], timeout_s=PROBE_TIMEOUT_S)
        except (WaitTimeout, ray.exceptions.RayError):
            return False
        world = self.cfg.trainer.world_size
        return all(not i.ready and i.process_group_inits == 0 and i.world_size == world and i.policy_uri == policy_path for i in infos)

    def trainer_ranks(self) -> list:
        """The live trainer ranks (None for a missing one), without any version check."""
        return [self.find(Role.TRAINER, r) for r in range(self.cfg.trainer.world_size)]

    def probe_trainers(self) -> tuple[list, object]:
        """(the live trainer ranks, the ObjectRef of rank 0's policy version; None when a
        rank is missing), for `trainers(..., probe=)`: sent ahead, the probe's round trip
        overlaps whatever the caller does meanwhile (the step's generation)."""
        ranks = self.trainer_ranks()
        return ranks, (ranks[0].policy_version.remote() if all(a is not None for a in ranks) else None)

    def trainers(
        self, expected_version: int, *, retrying_update: bool = False, at_least: bool = False, probe: tuple[list, object] | None = None
    ) -> list:  # fmt: skip
        """The trainer ranks, holding `expected_version` (or, for a retried train attempt
        whose first try already updated, the version after it; with `at_least`, any newer
        one). Ranks that were lost or hold another version are rebuilt from the last
        checkpoint and the logged updates after it (recovery.py). `probe`: what
        `probe_trainers` sent earlier, used instead of asking again."""
        from .recovery import restore_trainers

        ranks, held = probe if probe is not None else (self.trainer_ranks(), None)
        if self._trainers_hold(ranks, expected_version, retrying_update, at_least, log_mismatch=True, held=held):
            return ranks
        with restore_lease(self.run_id, Role.TRAINER, self.waiter):
            # Another activity may have rebuilt them while this one waited for the lease.
            ranks = self.trainer_ranks()
            if self._trainers_hold(ranks, expected_version, retrying_update, at_least):
                return ranks
            return restore_trainers(self, expected_version)

    def _trainers_hold(
        self, ranks: list, expected_version: int, retrying_update: bool, at_least: bool, *, log_mismatch: bool = False, held=None
    ) -> bool:  # fmt: skip
        if any(a is None for a in ranks):
            if log_mismatch:
                log.warning("run %s: a trainer rank is gone; restoring it", self.run_id)
            return False
        return self._holds(ranks[0], "the trainer", expected_version, retrying_update, at_least, log_mismatch, held)

    def _holds(
        self, actor, what: str, expected_version: int, retrying_update: bool, at_least: bool, log_mismatch: bool, held=None
    ) -> bool:  # fmt: skip
        """`actor` (trainer rank 0 or the critic) answers with the version the caller asked
        for (`held`: the ObjectRef of an answer already asked for)."""
        try:
            held = self.wait(held if held is not None else actor.policy_version.remote())
        except ray.exceptions.RayError:
            held = None  # died just now, or broken: rebuilt
        if held == expected_version or (retrying_update and held == expected_version + 1):
            return True
        if at_least and held is not None and held > expected_version:
            return True
        if log_mismatch:
            log.warning("run %s: %s holds v%s, the workflow expects v%d; restoring", self.run_id, what, held, expected_version)
        return False

    def kill_trainers(self) -> None:
        """Every trainer rank of the run, whatever world size it was started with."""
        prefix = self.name(Role.TRAINER, 0)[:-1]
        kill_named([n for n in run_actor_names().get(self.run_id, []) if n.startswith(prefix)])

    # -- rollout and reward --------------------------------------------------------------

    def start_rollout(self, policy_path: str, rank: int = 0):
        """Rollout replica `rank` (rollout-<rank>; one replica: rollout-0, as always)."""
        # Partial rollouts: a weight sync is received while a generation runs (a second thread).
        concurrency = 2 if self.cfg.uses_partial_rollouts else 1
        return self._create(
            RolloutWorker, Role.ROLLOUT, rank, self.cfg.resources.rollout_cpus, self.cfg, policy_path, self.run_uri,
            concurrency=concurrency,
        )  # fmt: skip

    def start_rollouts(self, policy_path: str) -> list:
        """Every rollout replica (rollout.replicas of them)."""
        return [self.start_rollout(policy_path, rank) for rank in range(self.cfg.rollout.replicas)]

    def start_reward(self, policy_path: str):
        return self._create(RewardWorker, Role.REWARD, 0, self.cfg.resources.reward_cpus, self.cfg, policy_path, self.run_uri)

    def rollout(self, expected_version: int, *, exact: bool = False):
        """Rollout replica 0 at `expected_version` or newer (a sync may land before the
        workflow hears of it), or with `exact` at that version only; recreated and synced
        if it was lost (evaluation; batches go through `generate`)."""
        return self.rollouts(expected_version, exact=exact, ranks=[0])[0]

    def rollouts(self, expected_version: int | None = None, *, exact: bool = False, ranks: list[int] | None = None) -> list:
        """The live rollout replicas (all rollout.replicas of them, or `ranks`), a lost one
        recreated. With `expected_version`, each brought to that version or newer (with
        `exact`: that version) as `rollout` does; without, as they are: a recreated one
        serves the initial policy until weights are loaded into it (what a weight sync does:
        `sync_weights` loads every replica this returns). Colocated: woken up first."""
        ranks = list(range(self.cfg.rollout.replicas)) if ranks is None else ranks
        actors = [self._live_replica(r) for r in ranks]
        probes = [a.policy_version.remote() for a in actors]
        held = []
        for i, rank in enumerate(ranks):
            try:
                held.append(self.wait(probes[i]))
            except ray.exceptions.RayActorError:
                # Killed just now: its name may still answer, its process does not.
                log.warning("run %s: rollout replica %d died; recreating it", self.run_id, rank)
                kill_named([self.name(Role.ROLLOUT, rank)])
                actors[i] = self.start_rollout(self.initial_policy(), rank)
                held.append(self.wait(actors[i].policy_version.remote()))
        if self.hands_over:
            self.wait([a.wake_up.remote() for a in actors])
        if expected_version is not None:
            self._bring_to(actors, held, expected_version, exact)
        return actors

    @property
    def hands_over(self) -> bool:
        """Whether the engines give the trainer their device memory between generating a
        batch and the update: colocated, in sync mode. The async modes generate while the
        trainer trains (a colocated GPU pool is refused for them at submit): put to sleep
        there (a CPU pool of every role), an engine would first wait for the generation
        in flight, and the batch's activity with it."""
        return self.plan.colocated and self.cfg.loop.mode == "sync"

    def sleep_rollouts(self) -> None:
        """`hands_over`: the engines release their device memory for the trainer (nothing
        on CPU); `rollouts` wakes them up again."""
        if self.hands_over:
            found = [self.find(Role.ROLLOUT, r) for r in range(self.cfg.rollout.replicas)]
            self.wait([a.sleep.remote() for a in found if a is not None])

    def generate(
        self, batch_index: int, prompt_start: int, prompt_count: int, policy_version: int, *, part: int = 0, exact: bool = False
    ) -> GenerateResult:
        """Generate and store rollout part `part` of batch `batch_index` on the rollout
        replicas (rollout_pool.py: split by load, whole groups per replica, a lost replica's
        share redone): the batch one replica would have stored."""
        from .rollout_pool import RolloutPool

        return RolloutPool(self).generate(batch_index, prompt_start, prompt_count, policy_version, part=part, exact=exact)

    def rollout_pool(self):
        """The rollout replicas as one pool (rollout_pool.py). Its `generate_shares` gives a
        batch generated over them but not stored (ObjectRefs of `RolloutShare`s in batch
        order, to hand on in memory; colocated: call `sleep_rollouts` before the trainer
        runs); after it, `.healthy` holds the replicas that generated it."""
        from .rollout_pool import RolloutPool

        return RolloutPool(self)

    def start_lost(self) -> None:
        """Start the rollout replicas and the reward worker that are gone, without waiting
        for them to be built: their processes import torch and load the model (seconds)
        while a lost trainer is rebuilt, instead of after it (a Ray restart or a lost
        node takes them all). Their next use finds them by name. Not colocated: a new
        engine would take device memory the trainer rebuilds in."""
        if self.plan.colocated:
            return
        for rank in range(self.cfg.rollout.replicas):
            self._live_replica(rank)
        if self.find(Role.REWARD) is None:
            log.warning("run %s: the reward worker is gone; recreating it", self.run_id)
            self.start_reward(self.initial_policy())

    def _live_replica(self, rank: int):
        actor = self.find(Role.ROLLOUT, rank)
        if actor is None:
            log.warning("run %s: rollout replica %d lost; recreating it", self.run_id, rank)
            actor = self.start_rollout(self.initial_policy(), rank)
        return actor

    def _bring_to(self, actors: list, held: list[int], expected_version: int, exact: bool) -> None:
        """Load the replicas `actors` (holding `held`) with v`expected_version` (exact) or
        newer; the trainer's weights are gathered once for all that need them."""
        # Through the object store whatever the placement: a rebuilt replica's one-off load.
        object_store = WEIGHT_TRANSPORTS.get("object_store")
        if exact:
            # A deterministic run: the version its schedule names, from the policy log, or
            # from the trainer if it holds that version now.
            stale = [a for a, v in zip(actors, held) if v != expected_version]
            logged = self.wait([a.serve_logged.remote(expected_version) for a in stale]) if stale else []
            stale = [a for a, ok in zip(stale, logged) if not ok]
            if stale:
                pushed = relayed_sync(object_store, self.trainers(expected_version, at_least=True), stale, self.wait).version
                if pushed != expected_version:
                    raise WorkerLost(
                        f"run {self.run_id}: policy v{expected_version} is not in the policy log and the trainer holds v{pushed}"
                    )
            return
        # A recreated replica serves v0: bring it to what the trainer holds now, which in
        # fully_async may be newer than this batch asked for (the batch records it).
        stale = [a for a, v in zip(actors, held) if v < expected_version]
        if stale:
            relayed_sync(object_store, self.trainers(expected_version, at_least=True), stale, self.wait)

    def start_critic(self):
        return self._create(CriticWorker, Role.CRITIC, 0, self.cfg.resources.critic_cpus, self.cfg, self.run_uri)

    def critic(self, expected_version: int, *, retrying_update: bool = False):
        """The critic, updated as often as policy v`expected_version` was (or once more, for
        a retried train attempt whose first try got that far); lost or out of step, it is
        rebuilt from the last checkpoint and the logged updates after it (recovery.py)."""
        from .recovery import restore_critic

        actor = self.find(Role.CRITIC)
        if self._critic_holds(actor, expected_version, retrying_update, log_mismatch=True):
            return actor
        with restore_lease(self.run_id, Role.CRITIC, self.waiter):
            actor = self.find(Role.CRITIC)
            if self._critic_holds(actor, expected_version, retrying_update):
                return actor
            return restore_critic(self, expected_version)

    def _critic_holds(self, actor, expected_version: int, retrying_update: bool, *, log_mismatch: bool = False) -> bool:
        if actor is None:
            if log_mismatch:
                log.warning("run %s: the critic is gone; restoring it", self.run_id)
            return False
        return self._holds(actor, "the critic", expected_version, retrying_update, False, log_mismatch)

    def reward(self):
        """The reward worker, constructed (its time limit covers scoring only)."""
        actor = self.find(Role.REWARD) or self.start_reward(self.initial_policy())
        key = actor._actor_id.hex()
        if key not in _CONSTRUCTED:  # once per actor: a recreated one has a new id
            self.wait(actor.__ray_ready__.remote())
            _CONSTRUCTED.add(key)
        return actor

    def score(self, batch_index: int, kind: str = RunLayout.BATCHES, part: int = 0) -> ScoreResult:
        """Score a stored batch within `reward.timeout_s`; past it, the reward worker is
        killed (the next attempt makes a fresh one) and RewardTimeout is raised."""
        return self._within_reward_timeout(self.reward().score.remote(batch_index, kind, part), batch_index, kind)

    def score_shares(self, batch_index: int, shares: list) -> tuple:
        """Score a batch handed over in memory (RolloutShare ObjectRefs; sync mode's `step`
        activity) as `score` does a stored one, then have the reward worker store batch and
        scores; returns the ObjectRefs (of the StepScores, of the store), not waited on: the
        trainer takes the scores straight from the reward worker. Wait on the scores with
        `handed_scores` (the reward timeout)."""
        actor = self.reward()
        scores = actor.score_shares.remote(batch_index, *shares)
        stored = actor.store_handed.remote(batch_index, scores, *shares)  # queued behind the scoring
        return scores, stored

    def handed_scores(self, scores, batch_index: int):
        """The StepScores of `score_shares`, waited on for at most `reward.timeout_s`."""
        return self._within_reward_timeout(scores, batch_index, RunLayout.BATCHES)

    def _within_reward_timeout(self, ref, batch_index: int, kind: str):
        """The reward worker's answer `ref`, waited on for at most `reward.timeout_s`."""
        timeout_s = self.cfg.reward.timeout_s
        try:
            return self.wait(ref, timeout_s=timeout_s)
        except WaitTimeout:
            kill_named([self.name(Role.REWARD)])
            raise RewardTimeout(
                f"run {self.run_id}: scoring batch {batch_index} of {kind}/ took longer than reward.timeout_s={timeout_s:g} s; the "
                "reward worker was killed and the next attempt uses a new one. Fix a reward function that hangs, or "
                "raise reward.timeout_s"
            ) from None

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
            targets = self.rollouts()
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
            ranks = self.trainers(version, at_least=True)
        transport = WEIGHT_TRANSPORTS.get(choose_transport(self.plan, self.cfg).value)
        return relayed_sync(transport, ranks, targets, self.wait, serving=transport.serving(self.plan, self.cfg, len(targets)))

    def shutdown(self, *, keep_admission: bool = False) -> list[str]:
        """Kill every actor of the run, whatever world size it had, and wait until their
        names (and so their CPUs) are free: the next run's check_resources counts on it.
        The run's admission grant goes too, unless `keep_admission` (a restore that
        rebuilds them at once: no queued run may take their CPUs in between)."""
        return release_run_actors(self.run_id, keep_admission=keep_admission)
