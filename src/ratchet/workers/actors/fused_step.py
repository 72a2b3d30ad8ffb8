"""Sync mode's whole step with its batch handed over in memory: generate, score, update and
sync in one call (the `step` activity's, one round trip through Temporal instead of four).

Every call is sent as soon as what it needs exists, and Ray hands the results on between
the actors: the trainer's version is probed while the batch generates, the trainer takes
the scores from the reward worker, and small weights (one sync bucket, through the object
store) are loaded by every replica as the update ends, each then generating the next batch
(a prefetch the next step's request finds). The reward worker stores the batch while the
update runs, and this returns only once it is stored, so every step the workflow counts has
its batch in the batch store (recovery replays it). A retried step whose update was made
already gets that update's result from the trainer's retry cache, which stores the batch it
used. Runs with a critic take the per-phase path instead (the critic reads the stored batch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ratchet.config.sync_transport import Transport, choose_transport

from ..batch import HandedSummary
from ..results import TrainResult
from .rollout_pool import prefetch_shares

if TYPE_CHECKING:
    from .run_actors import RunActors


@dataclass(frozen=True)
class StepRequest:
    batch_index: int
    prompt_start: int
    prompt_count: int
    generation_version: int  # the policy version the batch is generated with
    policy_version: int  # the version the update starts from
    kl_coef: float
    part: int = 0
    exact: bool = False  # a deterministic run: generated at exactly `generation_version`
    live: dict | None = None  # hyper-parameters set while the run trains (live_keys.py)
    safe_lambda: float | None = None
    next_prompt_start: int | None = None  # where the next batch starts, for its prefetch (None: the last step)
    retrying: bool = False  # a retried attempt: its first try may have made the update


@dataclass(frozen=True)
class StepSync:
    version: int
    seconds: float
    bytes: int  # loaded, summed over replicas


@dataclass(frozen=True)
class StepDone:
    summary: HandedSummary  # the batch trained on, as stored, with its scores
    trained: TrainResult
    train_seconds: float
    synced: StepSync


def fused_step(actors: RunActors, req: StepRequest) -> StepDone:
    version = req.policy_version
    probe = None
    if req.retrying:
        actors.start_lost()  # lost with the trainer (a Ray restart, a node): rebuilt side by side
        ranks = actors.trainer.at_version(version, retrying_update=True)
    else:
        probe = actors.trainer.probe()  # answered while the batch generates
    scores, shares, stored = None, [], []
    replicas: list = []
    pool = actors.rollout
    # A retried step whose update was made: the trainer reports (and stores) its batch.
    if not (req.retrying and actors.trainer.version(ranks) == version + 1):
        # Over the rollout replicas (rollout_group.py), kept in Ray's object store.
        shares = pool.generate_shares(
            req.batch_index, req.prompt_start, req.prompt_count, req.generation_version, part=req.part, exact=req.exact
        )  # fmt: skip
        scores, storing = actors.reward.score_shares(req.batch_index, shares)  # the reward worker stores the batch meanwhile
        stored.append(storing)
        pool.sleep()  # colocated: the engines give the trainer their memory
        # Every replica generated: the sync goes to these (else it looks every replica up).
        replicas = pool.healthy if len(pool.healthy) == actors.cfg.rollout.replicas else []
    if probe is not None:
        ranks = actors.trainer.at_version(version, probe=probe)
    t0 = time.perf_counter()
    # Small weights come back with the update for a one-call sync (object store transport,
    # replicas not woken up by that sync: not colocated).
    publish = bool(replicas) and not actors.plan.colocated and choose_transport(actors.plan, actors.cfg) is Transport.OBJECT_STORE
    calls = [
        a.train_handed.options(num_returns=3).remote(
            req.batch_index, version, req.kl_coef, scores, *shares, live=req.live, safe_lambda=req.safe_lambda, publish=publish
        )
        for a in ranks
    ]  # fmt: skip
    loads = []
    if publish:
        # Rank 0's published weights, loaded as they appear; each replica's prefetch is
        # queued behind its load and skipped if nothing was loaded.
        loads = [r.load_published.remote(calls[0][2]) for r in replicas]
        _prefetch_next(req, replicas, version + 1)
    if scores is not None:
        actors.reward.handed_scores(scores, req.batch_index)  # a failing or hanging reward function is reported as such
    outs = actors.wait([*(c[0] for c in calls), calls[0][1], *stored])
    trained, summary = outs[0], outs[len(calls)]
    train_seconds = time.perf_counter() - t0
    reports = actors.wait(loads) if loads else []
    if reports and all(r is not None for r in reports):
        synced = StepSync(version=reports[0].version, seconds=max(r.seconds for r in reports), bytes=sum(r.bytes for r in reports))
    else:
        # The ranks and replicas this step just used: not looked up and probed again.
        t1 = time.perf_counter()
        result = actors.sync_weights(trained.policy_version, ranks=ranks, targets=replicas or None)
        synced = StepSync(version=result.version, seconds=time.perf_counter() - t1, bytes=result.bytes)
        if replicas and not actors.plan.colocated:
            _prefetch_next(req, replicas, result.version)
    return StepDone(summary=summary, trained=trained, train_seconds=train_seconds, synced=synced)


def _prefetch_next(req: StepRequest, replicas: list, version: int) -> None:
    """The next batch, as the next step will ask for it, generated while Temporal records
    this step and schedules that one."""
    if req.next_prompt_start is not None:
        prefetch_shares(
            replicas, req.batch_index + 1, req.next_prompt_start, req.prompt_count, version, part=req.part, exact=req.exact
        )  # fmt: skip
