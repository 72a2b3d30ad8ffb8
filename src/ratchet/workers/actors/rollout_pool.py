"""A run's rollout replicas as one pool: a batch's prompts split over them by load (whole
prompts, so a GRPO group's n samples always come from one replica), a lost replica's share
redone on the healthy ones while the lost one is recreated, and the shares stored as the
one batch a single replica would have written.

Why the batch does not depend on the split: each prompt is sampled with a seed from the
batch's seed and its position in the batch (batch_seeds.prompt_seeds), and the shares
are joined in position order (`RolloutWorker.save_shares`), so 1, 2 or N replicas store the
same rows with the same tokens (log-probs equal up to float rounding of different batch
shapes, ~1e-6 on CPU).

Load: the prompts this process has sent to each replica and not yet got back (one Temporal
worker process runs every activity of its runs, so the async loops' overlapping generations
see each other); a new batch fills the least loaded replicas first.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray

from ratchet.errors import WorkerLost

from ..results import GenerateResult
from .names import Role, kill_named

if TYPE_CHECKING:
    from .run_actors import RunActors

log = logging.getLogger(__name__)

# Rounds of redoing lost shares before the activity fails (and Temporal retries it).
MAX_REDO_ROUNDS = 3

_load_lock = threading.Lock()
_in_flight: Counter[str] = Counter()  # prompts sent to each replica (by actor name), not yet back


@dataclass(frozen=True)
class Share:
    """Prompts `prompt_start` .. `+ prompt_count - 1` (dataset order, wrapping), at
    `position` .. of the batch, for replica `replica`."""

    replica: int
    prompt_start: int
    prompt_count: int
    position: int


def split_by_load(count: int, loads: list[int]) -> list[int]:
    """How many of `count` prompts each replica gets so that the most loaded ends as
    little loaded as possible (water filling; ties to the lower rank)."""
    shares = [0] * len(loads)
    for _ in range(count):
        i = min(range(len(loads)), key=lambda k: (loads[k] + shares[k], k))
        shares[i] += 1
    return shares


def plan_shares(prompt_start: int, prompt_count: int, position: int, replicas: list[int], loads: list[int]) -> list[Share]:
    """Contiguous shares of the prompts at `position` .. (from dataset index `prompt_start`)
    over `replicas` (ranks), sized by `split_by_load`, in rank order; empty ones left out."""
    out, offset = [], 0
    for rank, count in zip(replicas, split_by_load(prompt_count, loads)):
        if count:
            out.append(Share(rank, prompt_start + offset, count, position + offset))
            offset += count
    return out


@contextmanager
def _counted(names: dict[int, str], shares: list[Share]):
    with _load_lock:
        for s in shares:
            _in_flight[names[s.replica]] += s.prompt_count
    try:
        yield
    finally:
        with _load_lock:
            for s in shares:
                _in_flight[names[s.replica]] -= s.prompt_count
                if _in_flight[names[s.replica]] <= 0:
                    del _in_flight[names[s.replica]]


def prefetch_shares(
    replicas: list, batch_index: int, prompt_start: int, prompt_count: int, policy_version: int, *, part: int = 0,
    exact: bool = False,
) -> None:  # fmt: skip
    """Start generating a batch on `replicas` (in rank order, none busy: sync mode between
    two steps) without waiting: each keeps its share for the request that asks for it
    (`RolloutWorker.prefetch_share`). Split as `generate_shares` splits it with no load, so
    the request finds the same shares; a different split just generates anew."""
    ranks = list(range(len(replicas)))
    for s in plan_shares(prompt_start, prompt_count, 0, ranks, [0] * len(ranks)):
        replicas[s.replica].prefetch_share.remote(batch_index, s.prompt_start, s.prompt_count, policy_version, part, exact, s.position)


class RolloutPool:
    """The rollout replicas of one run (`rollout.replicas`), through its `RunActors`."""

    def __init__(self, actors: RunActors):
        self.actors = actors
        self.run_id = actors.run_id
        self.names = {r: actors.name(Role.ROLLOUT, r) for r in range(actors.cfg.rollout.replicas)}
        self.healthy: list = []  # the replicas that generated the last batch's shares

    def loads(self, ranks: list[int]) -> list[int]:
        with _load_lock:
            return [_in_flight.get(self.names[r], 0) for r in ranks]

    def generate(
        self, batch_index: int, prompt_start: int, prompt_count: int, policy_version: int, *, part: int = 0, exact: bool = False
    ) -> GenerateResult:
        """Generate and store rollout part `part` of batch `batch_index`. One replica: the
        replica generates and stores it itself, as before pools existed."""
        if len(self.names) == 1:
            replica = self.actors.rollouts(policy_version, exact=exact)[0]
            out = self.actors.wait(replica.generate.remote(batch_index, prompt_start, prompt_count, policy_version, part, exact))
        else:
            shares = self.generate_shares(batch_index, prompt_start, prompt_count, policy_version, part=part, exact=exact)
            out = self._save(batch_index, part, shares)
        self.actors.sleep_rollouts()  # colocated: the trainer runs next
        return out

    def generate_shares(
        self, batch_index: int, prompt_start: int, prompt_count: int, policy_version: int, *, part: int = 0, exact: bool = False
    ) -> list:
        """The batch as ObjectRefs of `RolloutShare`s in batch order, each generated (a lost
        replica's share redone elsewhere), none fetched into this process: for
        `RolloutWorker.save_shares`, or to hand on in memory (reward, trainer)."""
        replicas = dict(enumerate(self.actors.rollouts(policy_version, exact=exact)))
        todo = plan_shares(prompt_start, prompt_count, 0, list(replicas), self.loads(list(replicas)))
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
                replicas = dict(enumerate(self.actors.rollouts(policy_version, exact=exact)))
            healthy = sorted(replicas)
            todo = [
                sub for s in lost_shares for sub in plan_shares(s.prompt_start, s.prompt_count, s.position, healthy, self.loads(healthy))
            ]  # fmt: skip
            log.warning(
                "run %s: rollout replica(s) %s lost during batch %d; redoing %d prompts on replica(s) %s",
                self.run_id, sorted(lost_ranks), batch_index, sum(s.prompt_count for s in lost_shares), healthy,
            )  # fmt: skip
        raise WorkerLost(
            f"run {self.run_id}: rollout replicas kept failing during batch {batch_index} ({MAX_REDO_ROUNDS + 1} rounds); "
            "see the Ray logs of the rollout actors"
        )

    def _run(self, batch_index, part, policy_version, exact, replicas, todo: list[Share], done: list) -> tuple[list[Share], set[int]]:
        """Run the shares side by side; returns the shares whose replica died, and those replicas."""
        started = []
        with _counted(self.names, todo):
            for s in todo:
                call = replicas[s.replica].generate_share_and_version.options(num_returns=2)
                version_ref, share_ref = call.remote(batch_index, s.prompt_start, s.prompt_count, policy_version, part, exact, s.position)
                started.append((s, version_ref, share_ref))
            lost_shares, lost_ranks = [], set()
            for s, version_ref, share_ref in started:
                try:
                    self.actors.wait(version_ref)
                    done.append((s.position, share_ref))
                except ray.exceptions.RayActorError:
                    lost_shares.append(s)
                    lost_ranks.add(s.replica)
        return lost_shares, lost_ranks

    def _recreate(self, rank: int) -> None:
        """Start a fresh replica `rank` in the background of the batch: its name freed, the
        actor created (its engine loads while the others generate); `RunActors.rollouts`
        gives it the current weights before it serves."""
        kill_named([self.names[rank]])
        try:
            self.actors.start_rollout(self.actors.initial_policy(), rank)
        except Exception:  # noqa: BLE001 - the next `rollouts` call recreates it again
            log.warning("run %s: could not recreate rollout replica %d yet", self.run_id, rank, exc_info=True)

    def _save(self, batch_index: int, part: int, shares: list) -> GenerateResult:
        """Store the shares as one batch, joined by a live replica (the engine's pad id)."""
        last: Exception | None = None
        for attempt in range(MAX_REDO_ROUNDS):
            for replica in self.healthy if attempt == 0 else self.actors.rollouts():
                try:
                    return self.actors.wait(replica.save_shares.remote(batch_index, part, *shares))
                except ray.exceptions.RayActorError as exc:
                    last = exc
        raise WorkerLost(f"run {self.run_id}: no rollout replica could store batch {batch_index}: {last}")
