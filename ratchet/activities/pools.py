"""The Ray actors of a run: created once, found again by name.

Actors are named `<run id>/<role>-<rank>` in the `ratchet` namespace and detached, so a
restarted Temporal worker process finds the same actors instead of orphaning them. The
workflow owns the run state (DESIGN.md, rule 4): an activity checks the policy version a
worker holds against the one the workflow expects, and a rollout or reward worker that
was lost is recreated and brought up to date from the trainer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass

import ray
from temporalio import activity
from temporalio.exceptions import ApplicationError

from ratchet.config.schema import RunConfig
from ratchet.errors import RESOURCES_UNAVAILABLE, REWARD_TIMEOUT, WORKER_LOST
from ratchet.ids import is_valid_id
from ratchet.storage import ObjectStore
from ratchet.workers.critic import CriticWorker
from ratchet.workers.reward import RewardWorker
from ratchet.workers.rollout import RolloutWorker
from ratchet.workers.trainer import TRAINER_CONCURRENCY_GROUPS, TrainerWorker

from .ray_calls import WaitTimeout, wait

log = logging.getLogger(__name__)

NAMESPACE = "ratchet"
# An actor that no node could place in this long fails its activity instead of waiting
# forever; a placed actor may then take as long as its constructor needs.
PLACEMENT_TIMEOUT_S = 60.0
# Freed CPUs reach Ray's resource view a moment after the kill that freed them.
RESOURCE_SETTLE_S = 10.0
# How long a trainer rank that survived an earlier start_workers may take to answer.
PROBE_TIMEOUT_S = 10.0


def run_actor_names() -> dict[str, list[str]]:
    """Named actors in the `ratchet` namespace by run id (the name before '/')."""
    out: dict[str, list[str]] = defaultdict(list)
    for entry in ray.util.list_named_actors(all_namespaces=True):
        run_id, sep, _ = entry["name"].partition("/")
        if entry["namespace"] == NAMESPACE and sep and is_valid_id(run_id):
            out[run_id].append(entry["name"])
    return {k: sorted(v) for k, v in out.items()}


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


# Temporal's closed states; a run that is not found is closed too (its history is gone).
_OPEN = "RUNNING"


async def run_is_open(client, run_id: str) -> bool:
    """Whether workflow `run_id` (its latest execution) is still running. Errors other than
    not-found count as open: when in doubt, an actor is kept."""
    from temporalio.service import RPCError, RPCStatusCode

    try:
        desc = await client.get_workflow_handle(run_id).describe()
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return False
        log.warning("cannot tell whether run %s is open (%s); keeping its actors", run_id, exc)
        return True
    return desc.status is not None and desc.status.name == _OPEN


async def sweep_closed_runs(client) -> dict[str, list[str]]:
    """Release the actors of every run whose workflow is closed (completed, failed,
    cancelled, terminated, timed out) or unknown: a worker that died with its run, or a run
    terminated from outside, leaves detached actors that hold their CPUs forever otherwise.
    Returns {run id: actor names killed}."""
    runs = await asyncio.to_thread(run_actor_names)
    released = {}
    for run_id in sorted(runs):
        if await run_is_open(client, run_id):
            continue
        released[run_id] = await asyncio.to_thread(release_run_actors, run_id)
        log.warning("run %s is closed; released its leftover actors %s", run_id, ", ".join(released[run_id]))
    return released


def _actor_pid(actor) -> int | None:
    """The worker process id of an actor; 0 while no node has placed it, None if unknown.
    (Ray's private actor table: the public state API needs the dashboard.)"""
    try:
        from ray._private import state

        return int(state.actors(actor_id=actor._actor_id.hex()).get("Pid", 0) or 0)
    except Exception:  # noqa: BLE001 - an older or newer Ray: no placement check
        return None


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
        actor = remote_cls.options(**options).remote(*args)
        self._wait_placed(actor, self.name(role, rank), num_cpus)
        return actor

    def _wait_placed(self, actor, name: str, num_cpus: float, timeout_s: float = PLACEMENT_TIMEOUT_S) -> None:
        """Until a node runs the actor (not until its constructor is done); heartbeating.
        An actor that cannot be placed is killed (so it never takes CPUs later) and the
        activity fails naming who holds the CPUs."""
        deadline = time.monotonic() + timeout_s
        while True:
            pid = _actor_pid(actor)
            if pid is None or pid > 0:
                return
            if time.monotonic() >= deadline:
                break
            if activity.in_activity():
                activity.heartbeat(f"waiting for a node to place {name}")
            time.sleep(0.5)
        ray.kill(actor, no_restart=True)
        self.wait_name_free(name)
        raise ApplicationError(
            f"run {self.run_id}: no Ray node could place actor {name} ({num_cpus:g} CPUs) within {timeout_s:g} s; "
            f"{self._holders_text()}",
            type=RESOURCES_UNAVAILABLE,
            non_retryable=True,
        )

    def needed_cpus(self) -> float:
        r = self.cfg.resources
        need = r.trainer_cpus * self.cfg.trainer.world_size + r.rollout_cpus + r.reward_cpus
        return need + (r.critic_cpus if self.cfg.uses_critic else 0.0)

    def _held_by_own_actors(self, names: list[str]) -> float:
        """CPUs the run's existing actors hold (a restore or a retry kills or reuses them),
        by role as the run's config sets them."""
        r = self.cfg.resources
        per_role = {"trainer": r.trainer_cpus, "rollout": r.rollout_cpus, "reward": r.reward_cpus, "critic": r.critic_cpus}
        return sum(per_role.get(n.partition("/")[2].rpartition("-")[0], 0.0) for n in names)

    def _holders_text(self) -> str:
        others = {k: v for k, v in run_actor_names().items() if k != self.run_id}
        held = "; ".join(f"run {k}: {', '.join(v)}" for k, v in others.items()) or "no other run's actors"
        return (
            f"actors of other runs in the cluster: {held}. Stop the runs you no longer need (`ratchet stop RUN`), "
            "or lower resources.trainer_cpus / rollout_cpus / reward_cpus / critic_cpus (or trainer.world_size)"
        )

    def check_resources(self, settle_s: float = RESOURCE_SETTLE_S) -> None:
        """Fail at once, not after waiting for placement forever, when the CPUs the run
        needs are not free: Ray's free CPUs plus what this run's own actors already hold.
        Waits up to `settle_s` for CPUs that a kill just freed to show up."""
        need = self.needed_cpus()
        total = ray.cluster_resources().get("CPU", 0.0)
        deadline = time.monotonic() + settle_s
        while True:
            own = self._held_by_own_actors(run_actor_names().get(self.run_id, []))
            free = ray.available_resources().get("CPU", 0.0)
            if need <= free + own + 1e-9 or need > total or time.monotonic() >= deadline:
                break
            if activity.in_activity():
                activity.heartbeat("waiting for free CPUs")
            time.sleep(0.5)
        if need <= free + own + 1e-9:
            return
        what = (
            "resources.trainer_cpus x trainer.world_size + resources.rollout_cpus + resources.reward_cpus "
            "[+ resources.critic_cpus]"
        )
        if need > total:
            msg = (
                f"run {self.run_id} needs {need:g} Ray CPUs ({what}) but the cluster has {total:g}; "
                "lower the resources.* values or add nodes"
            )
        else:
            msg = (
                f"run {self.run_id} needs {need:g} Ray CPUs ({what}) but only {free + own:g} of the cluster's {total:g} are "
                f"free ({free:g} free + {own:g} held by this run's own actors); {self._holders_text()}"
            )
        raise ApplicationError(msg, type=RESOURCES_UNAVAILABLE, non_retryable=True)

    # -- trainer -------------------------------------------------------------------------

    def start_trainers(self, policy_path: str) -> int:
        """Create and set up every trainer rank; returns the parameter count. Idempotent: a
        retried start_workers reuses ranks that are all set up; ranks left half set up (a
        process group that may be broken) are killed and all ranks made afresh, since a
        surviving rank cannot join a new group."""
        world = self.cfg.trainer.world_size
        survivors = [self._find("trainer", r) for r in range(world)]
        if any(a is not None for a in survivors):
            count = self._set_up_count(survivors)
            if count is not None:
                log.info("run %s: trainer ranks already set up; reusing them", self.run_id)
                return count
            log.warning("run %s: trainer ranks half set up; recreating all %d", self.run_id, world)
            self.kill_trainers()
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

    def _set_up_count(self, ranks: list) -> int | None:
        """The parameter count if every rank exists and is set up (in one group), else None."""
        if any(a is None for a in ranks):
            return None
        try:
            infos = wait([a.setup_info.remote() for a in ranks], timeout_s=PROBE_TIMEOUT_S)
        except (WaitTimeout, ray.exceptions.RayError):
            return None  # busy (stuck in a collective) or dead
        if all(i["ready"] and i["world_size"] == len(ranks) for i in infos):
            return infos[0]["num_parameters"]
        return None

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
        names = [n for n in run_actor_names().get(self.run_id, []) if n.startswith(prefix)]
        for name in names:
            actor = self._find_named(name)
            if actor is not None:
                ray.kill(actor, no_restart=True)
        for name in names:
            self.wait_name_free(name)

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
        """The reward worker, constructed (its time limit covers scoring only)."""
        actor = self._find("reward") or self.start_reward(self.initial_policy())
        wait(actor.__ray_ready__.remote())
        return actor

    def score(self, step: int, kind: str = "batches", part: int = 0) -> dict:
        """Score a stored batch within `reward.timeout_s`; past it, the reward worker is
        killed (the next attempt makes a fresh one) and the attempt fails."""
        timeout_s = self.cfg.reward.timeout_s
        actor = self.reward()
        try:
            return wait(actor.score.remote(step, kind, part), timeout_s=timeout_s)
        except WaitTimeout:
            ray.kill(actor, no_restart=True)
            self.wait_name_free(self.name("reward"))
            raise ApplicationError(
                f"run {self.run_id}: scoring {kind} step {step} took longer than reward.timeout_s={timeout_s:g} s; the "
                "reward worker was killed and the next attempt uses a new one. Fix a reward function that hangs, or "
                "raise reward.timeout_s",
                type=REWARD_TIMEOUT,
            ) from None

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
        """Kill every actor of the run, whatever world size it had, and wait until their
        names (and so their CPUs) are free: the next run's check_resources counts on it."""
        return release_run_actors(self.run_id)
