"""The training workflow's scheduling maths, apart from its orchestration.

Which policy version generates a batch, whether the fully_async producer may start one,
when a sync, checkpoint, evaluation or continue-as-new is due, what a checkpoint records
of the work in flight, and a step's metrics line. Each loop mode's schedule is described in
its module's docstring (src/ratchet/workflows/training/loops/).

Pure and deterministic, standard library and `ratchet.types` only: the workflow imports
this module inside the Temporal sandbox, and tests/unit/test_scheduling.py checks it with
numbers, without a server.
"""

from __future__ import annotations

from dataclasses import replace

from ratchet.types import LoopPlan, RunState, ScoredBatch, SyncOutput, TrainOutput


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def num_samples(rounds: list[ScoredBatch]) -> int:
    return sum(r.batch.num_samples for r in rounds)


# -- which version generates a batch ---------------------------------------------------


def pipeline_lag(plan: LoopPlan) -> int:
    """Deterministic fully_async: how many versions a batch's generator trails its index,
    the deepest pipeline that exceeds neither the staleness bound (a batch generated just
    after a sync is trained up to `sync_every - 1` versions later) nor the queue."""
    return min(plan.max_staleness - plan.sync_every + 1, plan.queue_limit - 1)


def scheduled_version(plan: LoopPlan, index: int, version_floor: int = 0) -> int:
    """Deterministic fully_async: the policy version that generates batch `index`, the
    newest sync point at or before `index - lag`; after a resume, none older than the
    restored version (`version_floor`)."""
    return max(max(0, index - pipeline_lag(plan)) // plan.sync_every * plan.sync_every, version_floor)


def next_prompt_start(state: RunState) -> int:
    """Where the next batch's prompts start: prompts to roll out again come first (a
    checkpoint's batches in flight), then the frontier."""
    return state.retry_prompts[0] if state.retry_prompts else state.next_prompt


def generating_version(plan: LoopPlan, state: RunState, index: int) -> int:
    """The version batch `index` is generated with: the scheduled one in a deterministic
    fully_async run; otherwise whatever the rollout engine serves (sync and one_step_off
    sync at fixed points anyway, fully_async runs ahead by timing)."""
    if plan.deterministic and plan.mode == "fully_async":
        return scheduled_version(plan, index, state.version_floor)
    return state.rollout_version


# -- fully_async: the producer and the trainer -----------------------------------------


def may_start(plan: LoopPlan, state: RunState, *, in_flight: int, training: bool, trained_unrecorded: bool = False) -> bool:
    """fully_async: may the producer start batch `state.next_batch` now? `in_flight`
    batches are being generated, one is being trained if `training`, and one was trained
    but its step not yet counted (`state.next_step` moves when it is recorded, after the
    weight sync) if `trained_unrecorded`."""
    # Every batch ahead of a new one (training, ready, in flight) adds a version first.
    ahead = len(state.ready) + in_flight + int(training)
    # A trained, unrecorded batch adds no version any more, but it is one of the run's steps.
    total_batches = state.next_step + int(trained_unrecorded) + ahead
    if not (ahead < plan.queue_limit and total_batches < plan.steps):
        return False
    if plan.deterministic:
        return scheduled_version(plan, state.next_batch, state.version_floor) <= state.rollout_version
    # The new batch is trained after everything ahead of it: its staleness then.
    return state.policy_version + ahead - state.rollout_version <= plan.max_staleness


def sync_due(plan: LoopPlan, policy_version: int, updates_since_sync: int) -> bool:
    """fully_async, after an update: is a weight sync due?"""
    if plan.deterministic:
        # At fixed versions, also across continue-as-new (which resets the update count).
        return policy_version % plan.sync_every == 0
    return updates_since_sync >= plan.sync_every


# -- step boundaries -------------------------------------------------------------------


def _every(n: int, steps_done: int) -> bool:
    return bool(n and steps_done % n == 0)


def checkpoint_due(plan: LoopPlan, steps_done: int) -> bool:
    return _every(plan.checkpoint_every, steps_done)


def eval_due(plan: LoopPlan, steps_done: int) -> bool:
    return bool(plan.evaluate) and _every(plan.eval_every, steps_done)


def continue_as_new_due(plan: LoopPlan, steps_done: int, *, suggested: bool) -> bool:
    """After a step: continue as new if Temporal `suggested` it (the history is getting
    long) or every `continue_as_new_every` steps; never after the last step."""
    if steps_done >= plan.steps:
        return False
    return suggested or _every(plan.continue_as_new_every, steps_done)


def checkpoint_snapshot(state: RunState, in_flight: dict[int, int], in_flight_prompts: dict[int, list[int]]) -> RunState:
    """The run state a resume from a checkpoint taken now carries on from. Batches still
    being generated (`in_flight`: batch index -> version, `in_flight_prompts`: batch index
    -> prompt starts taken) are not in it: their prompts are queued first to be rolled out
    again, lowest batch index first, under the same batch indices (so a deterministic run
    samples them alike)."""
    retry = [p for i in sorted(in_flight_prompts) for p in in_flight_prompts[i]]
    return replace(
        state,
        retry_prompts=[*retry, *state.retry_prompts],
        ready=list(state.ready),
        next_batch=min(in_flight, default=state.next_batch),
    )


# -- a step's metrics line -------------------------------------------------------------


def reward_mean(rounds: list[ScoredBatch]) -> float:
    """The step's mean reward over all its rounds, each weighted by its samples."""
    return sum(r.score.reward_mean * r.batch.num_samples for r in rounds) / num_samples(rounds)


def tokens_per_second(rounds: list[ScoredBatch]) -> float:
    return sum(r.batch.num_response_tokens for r in rounds) / max(sum(r.batch.generate_seconds for r in rounds), 1e-9)


def step_metrics(
    state: RunState,
    rounds: list[ScoredBatch],
    trained: TrainOutput,
    synced: SyncOutput | None,
    *,
    wall_seconds: float,
    trainer_wait: float,
    rollout_busy_seconds: float,
    staleness: int | None = None,
) -> dict[str, float]:
    """One step's line of metrics.jsonl, from the state after the update. `wall_seconds`:
    the step's duration; `trainer_wait`: how long the trainer waited for a batch in it;
    `rollout_busy_seconds`: generation seconds since the previous step's line; `staleness`:
    fully_async's (trainer version minus batch version), else taken from the update."""
    samples = num_samples(rounds)
    wall = max(wall_seconds, 1e-9)
    batch_version = rounds[0].batch.policy_version
    return {
        "reward_mean": reward_mean(rounds),
        "reward_std": rounds[0].score.reward_std,
        "response_length": sum(r.batch.response_length_mean * r.batch.num_samples for r in rounds) / samples,
        "tokens_per_second": tokens_per_second(rounds),
        "policy_version": float(state.policy_version),
        "batch_index": float(rounds[0].batch.index),
        "batch_policy_version": float(batch_version),
        # How many versions behind the trained policy the samples were (0 in sync mode).
        "staleness": float(staleness if staleness is not None else trained.policy_version - 1 - batch_version),
        "rollout_rounds": float(len(rounds)),
        "generate_seconds": sum(r.batch.generate_seconds for r in rounds),
        "score_seconds": sum(r.score.seconds for r in rounds),
        "train_seconds": trained.seconds,
        "sync_seconds": synced.seconds if synced else 0.0,
        "sync_megabytes": synced.megabytes if synced else 0.0,
        "step_seconds": wall,
        "trainer_idle_fraction": min(trainer_wait / wall, 1.0),
        "rollout_idle_fraction": max(0.0, 1.0 - rollout_busy_seconds / wall),
        "queue_depth": float(len(state.ready)),
        "dropped_samples": float(state.dropped_samples),
        **{k: v for k, v in trained.metrics.items() if k not in ("response_length", "train_seconds")},
    }
