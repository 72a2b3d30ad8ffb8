"""A run's rollout replicas (`rollout.replicas`) as one group: started, found by name, a
lost one recreated, each brought to the policy version the workflow expects before it
serves, put to sleep and woken up where they share a device with the trainer, and a
batch generated over them (split by load: rollout_pool.py), a lost replica's share redone
on the healthy ones while it is recreated, stored as the one batch a single replica would
have written.

Why the batch does not depend on the split: each prompt is sampled with a seed from the
batch's seed and its position in the batch (batch_seeds.prompt_seeds), and the shares are
joined in position order (`RolloutWorker.save_shares`), so 1, 2 or N replicas store the
same rows with the same tokens (log-probs equal up to float rounding of different batch
shapes, ~1e-6 on CPU).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import ray

from ratchet.catalog.weight_transports import WEIGHT_TRANSPORTS
from ratchet.errors import WorkerLost

from ..results import GenerateResult
from ..rollout import RolloutWorker
from ..weight_sync.transport import relayed_sync
from .names import Role, kill_named
from .rollout_pool import Share, counted, loads, plan_shares

if TYPE_CHECKING:
    from .run_context import RunContext
    from .trainer_group import TrainerGroup

log = logging.getLogger(__name__)

# Rounds of redoing lost shares before the activity fails (and Temporal retries it).
MAX_REDO_ROUNDS = 3


class RolloutGroup:
    def __init__(self, run: RunContext, trainer: TrainerGroup):
        self.run = run
        self.trainer = trainer  # where a replica brought up to date gets its weights
        self.names = {r: run.name(Role.ROLLOUT, r) for r in range(run.cfg.rollout.replicas)}
        self.healthy: list = []  # the replicas that generated the last batch's shares

    # -- the replicas ----------------------------------------------------------------------

    def start_one(self, policy_path: str, rank: int = 0):
        """Rollout replica `rank` (rollout-<rank>; one replica: rollout-0)."""
        cfg = self.run.cfg
        # Partial rollouts: a weight sync is received while a generation runs (a second thread).
        concurrency = 2 if cfg.uses_partial_rollouts else 1
        return self.run.create(
            RolloutWorker, Role.ROLLOUT, rank, cfg.resources.rollout_cpus, cfg, policy_path, self.run.run_uri, concurrency=concurrency
        )

    def start(self, policy_path: str) -> list:
        """Every rollout replica (rollout.replicas of them)."""
        return [self.start_one(policy_path, rank) for rank in self.names]

    def replica(self, expected_version: int, *, exact: bool = False):
        """Replica 0 at `expected_version` or newer (a sync may land before the workflow
        hears of it), or with `exact` at that version only; recreated and synced if it was
        lost (evaluation; batches go through `generate`)."""
        return self.replicas(expected_version, exact=exact, ranks=[0])[0]

    def replicas(self, expected_version: int | None = None, *, exact: bool = False, ranks: list[int] | None = None) -> list:
        """The live replicas (all of them, or `ranks`), a lost one recreated. With
        `expected_version`, each brought to that version or newer (with `exact`: that
        version) as `replica` does; without, as they are: a recreated one serves the initial
        policy until weights are loaded into it (what a weight sync does: it loads every
        replica this returns). Colocated: woken up first."""
        ranks = list(self.names) if ranks is None else ranks
        actors = [self._live(r) for r in ranks]
        probes = [a.policy_version.remote() for a in actors]
        held = []
        for i, rank in enumerate(ranks):
            try:
                held.append(self.run.wait(probes[i]))
            except ray.exceptions.RayActorError:
                # Killed just now: its name may still answer, its process does not.
                log.warning("run %s: rollout replica %d died; recreating it", self.run.run_id, rank)
                kill_named([self.names[rank]])
                actors[i] = self.start_one(self.run.initial_policy(), rank)
                held.append(self.run.wait(actors[i].policy_version.remote()))
        if self.hands_over:
            self.run.wait([a.wake_up.remote() for a in actors])
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
        return self.run.plan.colocated and self.run.cfg.loop.mode == "sync"

    def sleep(self) -> None:
        """`hands_over`: the engines release their device memory for the trainer (nothing
        on CPU); `replicas` wakes them up again."""
        if self.hands_over:
            found = [self.run.find(Role.ROLLOUT, r) for r in self.names]
            self.run.wait([a.sleep.remote() for a in found if a is not None])

    def start_lost(self) -> None:
        """Start the replicas that are gone without waiting for them to be built (see
        `RunActors.start_lost`)."""
        for rank in self.names:
            self._live(rank)

    def _live(self, rank: int):
        actor = self.run.find(Role.ROLLOUT, rank)
        if actor is None:
            log.warning("run %s: rollout replica %d lost; recreating it", self.run.run_id, rank)
            actor = self.start_one(self.run.initial_policy(), rank)
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
            logged = self.run.wait([a.serve_logged.remote(expected_version) for a in stale]) if stale else []
            stale = [a for a, ok in zip(stale, logged) if not ok]
            if stale:
                ranks = self.trainer.at_version(expected_version, at_least=True)
                pushed = relayed_sync(object_store, ranks, stale, self.run.wait).version
                if pushed != expected_version:
                    raise WorkerLost(
                        f"run {self.run.run_id}: policy v{expected_version} is not in the policy log and the trainer holds v{pushed}"
                    )
            return
        # A recreated replica serves v0: bring it to what the trainer holds now, which in
        # fully_async may be newer than this batch asked for (the batch records it).
        stale = [a for a, v in zip(actors, held) if v < expected_version]
        if stale:
            relayed_sync(object_store, self.trainer.at_version(expected_version, at_least=True), stale, self.run.wait)

    # -- a batch over the replicas ---------------------------------------------------------

    def generate(
        self, batch_index: int, prompt_start: int, prompt_count: int, policy_version: int, *, part: int = 0, exact: bool = False
    ) -> GenerateResult:
        """Generate and store rollout part `part` of batch `batch_index`. One replica: the
        replica generates and stores it itself."""
        if len(self.names) == 1:
            replica = self.replicas(policy_version, exact=exact)[0]
            out = self.run.wait(replica.generate.remote(batch_index, prompt_start, prompt_count, policy_version, part, exact))
        else:
            shares = self.generate_shares(batch_index, prompt_start, prompt_count, policy_version, part=part, exact=exact)
            out = self._save(batch_index, part, shares)
        self.sleep()  # colocated: the trainer runs next
        return out

    def generate_shares(
        self, batch_index: int, prompt_start: int, prompt_count: int, policy_version: int, *, part: int = 0, exact: bool = False
    ) -> list:
        """The batch as ObjectRefs of `RolloutShare`s in batch order, each generated (a lost
        replica's share redone elsewhere), none fetched into this process: for
        `RolloutWorker.save_shares`, or to hand on in memory (reward, trainer). After it,
        `healthy` holds the replicas that generated it (colocated: call `sleep` before the
        trainer runs)."""
        replicas = dict(enumerate(self.replicas(policy_version, exact=exact)))
        todo = plan_shares(prompt_start, prompt_count, 0, list(replicas), self._loads(list(replicas)))
        done: list[tuple[int, object]] = []  # (position, share ref)
        for _round in range(MAX_REDO_ROUNDS + 1):
            lost_shares, lost_ranks = self._run(batch_index, part, policy_version, exact, replicas, todo, done)
            if not lost_shares:
                self.healthy = [replicas[r] for r in sorted(replicas)]
                return [ref for _, ref in sorted(done, key=lambda d: d[0])]
            for rank in lost_ranks:
                replicas.pop(rank, None)
                self._recreate(rank)
            if not replicas:
                # Every replica was lost: wait for the recreated ones, at the batch's version.
                replicas = dict(enumerate(self.replicas(policy_version, exact=exact)))
            healthy = sorted(replicas)
            todo = [
                sub for s in lost_shares for sub in plan_shares(s.prompt_start, s.prompt_count, s.position, healthy, self._loads(healthy))
            ]  # fmt: skip
            log.warning(
                "run %s: rollout replica(s) %s lost during batch %d; redoing %d prompts on replica(s) %s",
                self.run.run_id, sorted(lost_ranks), batch_index, sum(s.prompt_count for s in lost_shares), healthy,
            )  # fmt: skip
        raise WorkerLost(
            f"run {self.run.run_id}: rollout replicas kept failing during batch {batch_index} ({MAX_REDO_ROUNDS + 1} rounds); "
            "see the Ray logs of the rollout actors"
        )

    def _loads(self, ranks: list[int]) -> list[int]:
        return loads([self.names[r] for r in ranks])

    def _run(self, batch_index, part, policy_version, exact, replicas, todo: list[Share], done: list) -> tuple[list[Share], set[int]]:
        """Run the shares side by side; returns the shares whose replica died, and those replicas."""
        started = []
        with counted(self.names, todo):
            for s in todo:
                call = replicas[s.replica].generate_share_and_version.options(num_returns=2)
                version_ref, share_ref = call.remote(batch_index, s.prompt_start, s.prompt_count, policy_version, part, exact, s.position)
                started.append((s, version_ref, share_ref))
            lost_shares, lost_ranks = [], set()
            for s, version_ref, share_ref in started:
                try:
                    self.run.wait(version_ref)
                    done.append((s.position, share_ref))
                except ray.exceptions.RayActorError:
                    lost_shares.append(s)
                    lost_ranks.add(s.replica)
        return lost_shares, lost_ranks

    def _recreate(self, rank: int) -> None:
        """Start a fresh replica `rank` in the background of the batch: its name freed, the
        actor created (its engine loads while the others generate); `replicas` gives it the
        current weights before it serves."""
        kill_named([self.names[rank]])
        try:
            self.start_one(self.run.initial_policy(), rank)
        except Exception:  # noqa: BLE001 - the next `replicas` call recreates it again
            log.warning("run %s: could not recreate rollout replica %d yet", self.run.run_id, rank, exc_info=True)

    def _save(self, batch_index: int, part: int, shares: list) -> GenerateResult:
        """Store the shares as one batch, joined by a live replica (the engine's pad id)."""
        last: Exception | None = None
        for attempt in range(MAX_REDO_ROUNDS):
            for replica in self.healthy if attempt == 0 else self.replicas():
                try:
                    return self.run.wait(replica.save_shares.remote(batch_index, part, *shares))
                except ray.exceptions.RayActorError as exc:
                    last = exc
        raise WorkerLost(f"run {self.run.run_id}: no rollout replica could store batch {batch_index}: {last}")
