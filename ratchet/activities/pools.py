"""The Ray actors of a run: created once, found again by name.

Actors are named `<run id>/<role>-<rank>` in the `ratchet` namespace and detached, so a
restarted Temporal worker process finds the same actors instead of orphaning them. The
workflow owns the run state (DESIGN.md, rule 4): an activity checks the policy version a
worker holds against the one the workflow expects, and a rollout or reward worker that
was lost is recreated and brought up to date from the trainer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import ray
from temporalio.exceptions import ApplicationError

from ratchet.config.schema import RunConfig
from ratchet.storage import ObjectStore
from ratchet.workers.critic import CriticWorker
from ratchet.workers.reward import RewardWorker
from ratchet.workers.rollout import RolloutWorker
from ratchet.workers.trainer import TRAINER_CONCURRENCY_GROUPS, TrainerWorker

from .ray_calls import wait

log = logging.getLogger(__name__)

NAMESPACE = "ratchet"
# Lost state that only a checkpoint could restore: retrying cannot help.
WORKER_LOST = "WorkerLost"


def release_run_actors(run_id: str, *, timeout_s: float = 30.0) -> list[str]:
    """Kill every named actor of run `run_id` (whatever roles and world size it had) and
    wait for their names to be free; returns the names killed. Needs no config, so it
    works on every way out of a run, also when the run failed before its config was stored."""
    prefix = f"{run_id}/"
    killed = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != NAMESPACE or not entry["name"].startswith(prefix):
            continue
        try:
            ray.kill(ray.get_actor(entry["name"], namespace=NAMESPACE), no_restart=True)
        except ValueError:
            continue  # gone meanwhile
        killed.append(entry["name"])
    deadline = time.monotonic() + timeout_s
    for name in killed:
        while RunPools._find_named(name) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
    return killed


def _actor_env(cfg: RunConfig) -> dict:
    threads = str(cfg.resources.torch_threads)
    return {"env_vars": {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}}


@dataclass
class RunPools:
    run_id: str
    run_uri: str
    cfg: RunConfig

    def name(self, role: str, rank: int = 0) -> str:
        return f"{self.run_id}/{role}-{rank}"

    def _find(self, role: str, rank: int = 0):
        return self._find_named(self.name(role, rank))

    @staticmethod
    def _find_named(name: str):
        try:
            return ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return None

    def _create(self, cls, role: str, rank: int, num_cpus: float, *args, concurrency: int = 1, groups: dict | None = None):
        options = dict(
            name=self.name(role, rank),
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=num_cpus,
            max_concurrency=concurrency,
            runtime_env=_actor_env(self.cfg),
        )
        remote_cls = ray.remote(concurrency_groups=groups)(cls) if groups else ray.remote(cls)
        return remote_cls.options(**options).remote(*args)

    def check_resources(self) -> None:
        """Fail at once, not after a timeout, when the cluster can never place the actors."""
        r = self.cfg.resources
        need = r.trainer_cpus * self.cfg.trainer.world_size + r.rollout_cpus + r.reward_cpus
        need += r.critic_cpus if self.cfg.uses_critic else 0.0
        have = ray.cluster_resources().get("CPU", 0.0)
        if need > have:
            raise ApplicationError(
                f"run {self.run_id} needs {need:g} Ray CPUs (resources.trainer_cpus x trainer.world_size + "
                f"resources.rollout_cpus + resources.reward_cpus [+ resources.critic_cpus]) but the cluster has {have:g}; "
                "lower the resources.* values or add nodes",
                type="ConfigError",
                non_retryable=True,
            )

    # -- trainer -------------------------------------------------------------------------

    def start_trainers(self, policy_path: str) -> int:
        """Create and set up every trainer rank; returns the parameter count."""
        world = self.cfg.trainer.world_size
        ranks = [
            self._create(
                TrainerWorker, "trainer", r, self.cfg.resources.trainer_cpus, self.cfg, policy_path, self.run_uri, r, world,
                groups=TRAINER_CONCURRENCY_GROUPS,
            )  # fmt: skip
            for r in range(world)
        ]
        port = wait(ranks[0].rendezvous_port.remote())
        counts = wait([a.setup.remote(port) for a in ranks])
        return counts[0]

    def trainers(self, expected_version: int, *, retrying_update: bool = False, at_least: bool = False) -> list:
        """The trainer ranks, holding `expected_version` (or, for a retried train attempt
        whose first try already updated, the version after it; with `at_least`, any newer
        one). Ranks that were lost or hold another version are rebuilt from the last
        checkpoint and the logged updates after it (recovery.py)."""
        from .recovery import restore_trainers

        ranks = [self._find("trainer", r) for r in range(self.cfg.trainer.world_size)]
        if all(a is not None for a in ranks):
            try:
                held = wait(ranks[0].policy_version.remote())
            except ray.exceptions.RayError:
                held = None  # died just now, or broken: rebuilt below
            if held == expected_version or (retrying_update and held == expected_version + 1):
                return ranks
            if at_least and held is not None and held > expected_version:
                return ranks
            log.warning("run %s: trainer holds v%s, the workflow expects v%d; restoring", self.run_id, held, expected_version)
        else:
            log.warning("run %s: a trainer rank is gone; restoring it", self.run_id)
        return restore_trainers(self, expected_version)

    def kill_trainers(self) -> None:
        """Every trainer rank of the run, whatever world size it was started with."""
        prefix = self.name("trainer", 0)[:-1]
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry["namespace"] == NAMESPACE and entry["name"].startswith(prefix):
                ray.kill(ray.get_actor(entry["name"], namespace=NAMESPACE), no_restart=True)
                self.wait_name_free(entry["name"])

    def wait_name_free(self, name: str, timeout_s: float = 30.0) -> None:
        """The kill of a named actor is asynchronous: wait until the name is free, or a new
        actor created with get_if_exists would be the dying one."""
        deadline = time.monotonic() + timeout_s
        while self._find_named(name) is not None and time.monotonic() < deadline:
            time.sleep(0.1)

    def initial_policy(self) -> str:
        """The weights RL starts from: the warmed-up model if the run has a warm-up."""
        return ObjectStore(self.run_uri).uri("warmup/model") if self.cfg.warmup.steps > 0 else self.cfg.model.path

    # -- rollout and reward --------------------------------------------------------------

    def start_rollout(self, policy_path: str):
        # Partial rollouts: a weight sync is received while a generation runs (a second thread).
        concurrency = 2 if self.cfg.uses_partial_rollouts else 1
        return self._create(
            RolloutWorker, "rollout", 0, self.cfg.resources.rollout_cpus, self.cfg, policy_path, self.run_uri, concurrency=concurrency
        )

    def start_reward(self, policy_path: str):
        return self._create(RewardWorker, "reward", 0, self.cfg.resources.reward_cpus, self.cfg, policy_path, self.run_uri)

    def rollout(self, expected_version: int, *, exact: bool = False):
        """The rollout worker at `expected_version` or newer (a sync may land before the
        workflow hears of it), or with `exact` at that version only; recreated and synced
        if it was lost."""
        actor = self._find("rollout")
        if actor is None:
            log.warning("run %s: rollout worker lost; recreating it", self.run_id)
            actor = self.start_rollout(self.initial_policy())
        held = wait(actor.policy_version.remote())
        if exact and held != expected_version:
            # A deterministic run: the version its schedule names, from the policy log, or
            # from the trainer if it holds that version now.
            if not wait(actor.serve_logged.remote(expected_version)):
                pushed = self._push_weights(self.trainers(expected_version, at_least=True), actor)[1]
                if pushed != expected_version:
                    raise ApplicationError(
                        f"run {self.run_id}: policy v{expected_version} is not in the policy log and the trainer holds v{pushed}",
                        type=WORKER_LOST,
                        non_retryable=True,
                    )
        elif held < expected_version:
            # A recreated worker serves v0: bring it to what the trainer holds now, which in
            # fully_async may be newer than this batch asked for (the batch records it).
            self._push_weights(self.trainers(expected_version, at_least=True), actor)
        return actor

    def start_critic(self):
        return self._create(CriticWorker, "critic", 0, self.cfg.resources.critic_cpus, self.cfg, self.run_uri)

    def critic(self, expected_version: int, *, retrying_update: bool = False):
        """The critic, updated as often as policy v`expected_version` was (or once more, for
        a retried train attempt whose first try got that far); lost or out of step, it is
        rebuilt from the last checkpoint and the logged updates after it (recovery.py)."""
        from .recovery import restore_critic

        actor = self._find("critic")
        if actor is not None:
            try:
                held = wait(actor.policy_version.remote())
            except ray.exceptions.RayError:
                held = None
            if held == expected_version or (retrying_update and held == expected_version + 1):
                return actor
            log.warning("run %s: the critic holds v%s, the workflow expects v%d; restoring", self.run_id, held, expected_version)
        else:
            log.warning("run %s: the critic is gone; restoring it", self.run_id)
        return restore_critic(self, expected_version)

    def reward(self):
        return self._find("reward") or self.start_reward(self.initial_policy())

    def sync_weights(self, version: int) -> tuple[int, int]:
        """Trainer weights (v`version`, or newer when fully_async trains on meanwhile) -> the
        rollout engine; returns (bytes moved, the version synced)."""
        target = self._find("rollout") or self.start_rollout(self.initial_policy())
        if self.cfg.uses_partial_rollouts:
            pushed = self._push_published(target, at_least=version)
            if pushed is not None:
                return pushed
        return self._push_weights(self.trainers(version, at_least=True), target)

    def _push_published(self, target, at_least: int) -> tuple[int, int] | None:
        """fully_async with partial rollouts, where a sync overlaps the next update: the
        weights rank 0 published at the end of its last update, read without queueing
        behind the update running now. None (use `_push_weights`) when there are none of
        v`at_least` or newer, or the trainer is gone."""
        rank0 = self._find("trainer", 0)
        if rank0 is None:
            return None
        try:
            published = wait(rank0.published_weights.remote())
        except ray.exceptions.RayError:
            return None
        if published is None or published[0] < at_least:
            return None
        version, ref = published
        return wait(target.load_weights.remote(ref, version)), version

    def _push_weights(self, ranks: list, target) -> tuple[int, int]:
        """Through Ray's object store (never via this process: the ObjectRef is passed on and
        resolved in the rollout actor). Returns (bytes moved, version)."""
        while True:
            # Calls from one caller run in order on an actor; an update from another caller
            # may land between them, and then the versions before and after differ.
            before = ranks[0].policy_version.remote()
            refs = [a.weights.remote() for a in ranks]
            after = ranks[0].policy_version.remote()
            version, again = wait([before, after])
            if version == again:
                break
        received = wait(target.load_weights.remote(refs[0], version))
        wait(refs[1:])
        return received, version

    def shutdown(self) -> list[str]:
        killed = []
        roles = [("rollout", 0), ("reward", 0), ("critic", 0)] + [("trainer", r) for r in range(max(2, self.cfg.trainer.world_size))]
        for role, rank in roles:
            actor = self._find(role, rank)
            if actor is not None:
                ray.kill(actor, no_restart=True)
                killed.append(self.name(role, rank))
        return killed
