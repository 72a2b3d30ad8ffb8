"""The activities of the training workflow: thin adapters from Temporal to the Ray workers.

Each takes one dataclass and returns one (ratchet.types). They hold no run state of their
own: what they need is in the input or in the run folder, so any worker process can run
any activity of any run, and a retry redoes exactly the same work.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time

import temporalio.converter
from temporalio import activity

from ratchet.config.schema import RunConfig
from ratchet.config.sync_transport import Transport, choose_transport
from ratchet.errors import CheckpointFailed
from ratchet.storage import BatchStore, MetricsLog, ObjectStore, RunLayout
from ratchet import types as t
from ratchet.ids import check_id
from ratchet.workers.actors import RunActors, release_run_actors
from ratchet.workers.actors.rollout_pool import prefetch_shares
from ratchet.workers.background import BackgroundCall
from ratchet.workers.columns import Parts
from ratchet.workers.results import CheckpointOutcome, CheckpointStarted

from . import registry_calls
from . import tracking_calls
from .admission import admit_run
from .run_config import stored_run_config
from .ray_calls import ACTIVITY_WAITER, wait
from .translate import temporal_errors

log = logging.getLogger(__name__)
# Run states go into checkpoints as the same JSON Temporal would carry them in.
PAYLOADS = temporalio.converter.default().payload_converter


def config_digest(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def actors_for(run: t.RunRef) -> RunActors:
    """The run's actors, waiting on them with heartbeats."""
    return RunActors(run.run_id, run.run_uri, stored_run_config(run.run_uri, run.config_id), waiter=ACTIVITY_WAITER)


@activity.defn(name="prepare_run")
@temporal_errors
def prepare_run(inp: t.PrepareInput) -> t.PrepareOutput:
    """Create the run folder and store the (already validated) config in it."""
    cfg = RunConfig.model_validate(inp.config)
    run_store = ObjectStore(cfg.storage.root).child(inp.run_id)
    stored = cfg.model_dump(mode="json")
    run_store.put_json(RunLayout.CONFIG, stored)
    if inp.lineage != t.RunLineage():
        run_store.put_json(RunLayout.LINEAGE, dataclasses.asdict(inp.lineage))
    tracking_calls.run_prepared(inp, run_store.url, stored)
    registry_calls.run_prepared(inp, stored, config_digest(stored))
    return t.PrepareOutput(run=t.RunRef(run_id=inp.run_id, run_uri=run_store.url, config_id=config_digest(stored)))


@activity.defn(name="warmup")
@temporal_errors
def warmup(inp: t.WarmupInput) -> t.WarmupOutput:
    cfg = stored_run_config(inp.run.run_uri, inp.run.config_id)
    if cfg.warmup.steps == 0:
        return t.WarmupOutput(policy_uri=cfg.model.path, loss_first=0.0, loss_last=0.0, seconds=0.0)
    actors = actors_for(inp.run)
    # The reward worker needs only the tokenizer, which the warm-up leaves as it is: its
    # process starts (and imports torch, seconds) while trainer rank 0 warms up the model
    # in the process that then trains it; start_workers finds both by name.
    actors.start_reward(cfg.model.path)
    out = actors.warm_up(cfg.model.path)
    return t.WarmupOutput(policy_uri=out.uri, loss_first=out.loss_first, loss_last=out.loss_last, seconds=out.seconds)


@activity.defn(name="start_workers")
@temporal_errors
def start_workers(inp: t.StartWorkersInput) -> t.StartWorkersOutput:
    """Create the run's actors (the run holds its admission grant: `admit_run`; each actor
    re-registers it, see placement.create_actor). On a resume from a checkpoint
    (`restore_version` set), first release whatever actors the run still has, and rebuild
    the trainer at that version."""
    t0 = time.perf_counter()
    actors = actors_for(inp.run)
    actors.check_resources()
    if inp.restore_version is not None:
        actors.shutdown(keep_admission=True)  # rebuilt at once: no queued run takes their CPUs
        actors.trainers(inp.restore_version)
        source = actors.initial_policy()
        wait([*(a.policy_version.remote() for a in actors.start_rollouts(source)), actors.start_reward(source).__ray_ready__.remote()])
        if actors.cfg.uses_critic:
            actors.critic(inp.restore_version)  # from the checkpoint, like the trainer
        return t.StartWorkersOutput(policy_version=inp.restore_version, num_parameters=0, seconds=time.perf_counter() - t0)
    # Every actor's process starts and imports torch (seconds each) at once: the rollout
    # replicas, the reward worker and the critic are created first and load while the
    # trainer ranks set up.
    ready = [
        *(a.policy_version.remote() for a in actors.start_rollouts(inp.policy_uri)),
        actors.start_reward(inp.policy_uri).__ray_ready__.remote(),
    ]
    if actors.cfg.uses_critic:
        ready.append(actors.start_critic().__ray_ready__.remote())
    n_params = actors.start_trainers(inp.policy_uri)
    wait(ready)
    return t.StartWorkersOutput(policy_version=0, num_parameters=n_params, seconds=time.perf_counter() - t0)


@activity.defn(name="generate")
@temporal_errors
def generate(inp: t.RolloutInput) -> t.BatchRef:
    actors = actors_for(inp.run)
    # Over the rollout replicas (workers/actors/rollout_pool.py); one replica: as before.
    out = actors.generate(inp.batch_index, inp.prompt_start, inp.prompt_count, inp.policy_version, part=inp.part, exact=inp.exact_version)
    return _batch_ref(inp, out.uri, out)


def _batch_ref(inp: t.RolloutInput, uri: str, out) -> t.BatchRef:
    """The stored batch `inp` asked for, as the workflow sees it; `out` (a GenerateResult
    or the trainer's HandedSummary) says what was generated."""
    return t.BatchRef(
        run_id=inp.run.run_id,
        index=inp.batch_index,
        uri=uri,
        num_prompts=inp.prompt_count,
        num_samples=out.num_samples,
        num_response_tokens=out.num_response_tokens,
        policy_version=out.policy_version,
        part=inp.part,
        prompt_start=inp.prompt_start,
        generate_seconds=out.generate_seconds,
        response_length_mean=out.response_length_mean,
    )


@activity.defn(name="score")
@temporal_errors
def score(inp: t.ScoreInput) -> t.ScoreOutput:
    actors = actors_for(inp.run)
    out = actors.score(inp.batch.index, RunLayout.BATCHES, inp.batch.part)
    return t.ScoreOutput(
        reward_mean=out.reward_mean, reward_std=out.reward_std, seconds=out.seconds, informative_groups=out.informative_groups
    )


@activity.defn(name="train")
@temporal_errors
def train(inp: t.TrainInput) -> t.TrainOutput:
    """Policy update; with a critic (GAE), values first and the critic's own update after."""
    t0 = time.perf_counter()
    actors = actors_for(inp.run)
    batch_index, parts = inp.batch.index, inp.parts
    retrying = activity.info().attempt > 1
    critic = actors.critic(inp.policy_version, retrying_update=retrying) if actors.cfg.uses_critic else None
    if critic is not None:
        wait(critic.compute_values.remote(batch_index, parts))
    ranks = actors.trainers(inp.policy_version, retrying_update=retrying)
    # `live`: hyper-parameters set while the run trains (live_keys.py), for this update.
    outs = wait(
        [
            a.train.remote(batch_index, inp.policy_version, inp.kl_coef, parts, live=inp.live or None, safe_lambda=inp.safe_lambda)
            for a in ranks
        ]
    )
    metrics = dict(outs[0].metrics)
    if critic is not None:
        metrics.update(wait(critic.update.remote(batch_index, parts)))
    return t.TrainOutput(
        policy_version=outs[0].policy_version, metrics=metrics, seconds=time.perf_counter() - t0, kl_coef=outs[0].kl_coef,
        safe_lambda=outs[0].safe_lambda,
    )  # fmt: skip


@activity.defn(name="sync_weights")
@temporal_errors
def sync_weights(inp: t.SyncInput) -> t.SyncOutput:
    return _synced(actors_for(inp.run), inp.policy_version)


def _synced(actors: RunActors, version: int, ranks: list | None = None, replicas: list | None = None) -> t.SyncOutput:
    t0 = time.perf_counter()
    out = actors.sync_weights(version, ranks=ranks, targets=replicas)
    return t.SyncOutput(policy_version=out.version, seconds=time.perf_counter() - t0, megabytes=out.bytes / 1e6)


@activity.defn(name="step")
@temporal_errors
def step(inp: t.StepInput) -> t.StepOutput:
    """Sync mode's whole step: generate, score, train, sync, in one activity (one round
    trip through Temporal instead of four). The batch goes from the rollout worker to the
    reward worker and the trainer through Ray's object store; trainer rank 0 stores it
    while it updates, and this returns only once it is stored, so every step the workflow
    counts has its batch in the batch store (recovery replays it). A retry is idempotent:
    a trainer that already made this update answers from its retry cache and stores the
    batch it used. With a critic the batch is stored first (the critic reads it there).
    The previous step's metrics line (`inp.record`) is written alongside, whatever this
    step's outcome."""
    record = inp.record
    recording = BackgroundCall(lambda: write_record(record), "write-record") if record is not None else None
    try:
        out = _step(inp)
    finally:
        if recording is not None:
            recording.join()
    if recording is not None and recording.error is not None:
        raise recording.error
    return out


def _step(inp: t.StepInput) -> t.StepOutput:
    ro = inp.rollout
    actors = actors_for(ro.run)
    if actors.cfg.uses_critic:
        batch = generate(ro)
        scored = score(t.ScoreInput(ro.run, batch))
        trained = train(t.TrainInput(ro.run, batch, inp.policy_version, kl_coef=inp.kl_coef, live=inp.live, safe_lambda=inp.safe_lambda))
        synced = sync_weights(t.SyncInput(ro.run, trained.policy_version))
        return t.StepOutput(batch=batch, score=scored, trained=trained, synced=synced)
    batch, scored, trained, (ranks, replicas, synced) = _step_in_memory(actors, inp)
    if synced is None:
        # The ranks and replicas this step just used: not looked up and probed again.
        synced = _synced(actors, trained.policy_version, ranks, replicas or None)
        if inp.next_prompt_start is not None and replicas and not actors.plan.colocated:
            _prefetch_next(inp, replicas, synced.policy_version)
    return t.StepOutput(batch=batch, score=scored, trained=trained, synced=synced)


def _prefetch_next(inp: t.StepInput, replicas: list, version: int) -> None:
    """The next batch, as the next step will ask for it, generated while Temporal records
    this step and schedules that one."""
    ro = inp.rollout
    prefetch_shares(
        replicas, ro.batch_index + 1, inp.next_prompt_start, ro.prompt_count, version, part=ro.part, exact=ro.exact_version
    )  # fmt: skip


def _step_in_memory(actors: RunActors, inp: t.StepInput) -> tuple[t.BatchRef, t.ScoreOutput, t.TrainOutput, tuple[list, list, object]]:
    """The step with its batch handed over in memory; also returns the trainer ranks and
    the rollout replicas it used (none on a retry that found the update made, or when a
    replica was lost and recreated during the batch: then the sync looks every replica
    up), and the sync if the new weights went to the replicas with the update (else None).

    Every call is sent as soon as what it needs exists, and Ray hands the results on
    between the actors: the trainer's version is probed while the batch generates, the
    trainer takes the scores from the reward worker, and small weights (one sync bucket,
    through the object store) are loaded by every replica as the update ends, each then
    generating the next batch. The activity waits once, for all of it."""
    ro, version = inp.rollout, inp.policy_version
    retrying = activity.info().attempt > 1
    probe = None
    if retrying:
        actors.start_lost()  # lost with the trainer (a Ray restart, a node): rebuilt side by side
        ranks = actors.trainers(version, retrying_update=True)
    else:
        probe = actors.probe_trainers()  # answered while the batch generates
    scores, shares, stored = None, [], []
    replicas: list = []
    pool = actors.rollout_pool()
    # A retried step whose update was made: the trainer reports (and stores) its batch.
    if not (retrying and wait(ranks[0].policy_version.remote()) == version + 1):
        # Over the rollout replicas (rollout_pool.py), kept in Ray's object store.
        shares = pool.generate_shares(
            ro.batch_index, ro.prompt_start, ro.prompt_count, ro.policy_version, part=ro.part, exact=ro.exact_version
        )
        scores, storing = actors.score_shares(ro.batch_index, shares)  # the reward worker stores the batch meanwhile
        stored.append(storing)
        actors.sleep_rollouts()  # colocated: the engines give the trainer their memory
        replicas = pool.healthy if len(pool.healthy) == actors.cfg.rollout.replicas else []
    if probe is not None:
        ranks = actors.trainers(version, probe=probe)
    t0 = time.perf_counter()
    live = inp.live or None
    # Small weights come back with the update for a one-call sync (object store transport,
    # replicas not woken up by that sync: not colocated).
    publish = bool(replicas) and not actors.plan.colocated and choose_transport(actors.plan, actors.cfg) is Transport.OBJECT_STORE
    calls = [
        a.train_handed.options(num_returns=3).remote(
            ro.batch_index, version, inp.kl_coef, scores, *shares, live=live, safe_lambda=inp.safe_lambda, publish=publish
        )
        for a in ranks
    ]  # fmt: skip
    loads = []
    if publish:
        # Rank 0's published weights, loaded as they appear; each replica's prefetch is
        # queued behind its load and skipped if nothing was loaded.
        loads = [r.load_published.remote(calls[0][2]) for r in replicas]
        if inp.next_prompt_start is not None:
            _prefetch_next(inp, replicas, version + 1)
    if scores is not None:
        actors.handed_scores(scores, ro.batch_index)  # a failing or hanging reward function is reported as such
    outs = wait([*(c[0] for c in calls), calls[0][1], *stored])
    trained, summary = outs[0], outs[len(calls)]
    seconds = time.perf_counter() - t0
    reports = wait(loads) if loads else []
    synced = None
    if reports and all(r is not None for r in reports):
        synced = t.SyncOutput(
            policy_version=reports[0].version, seconds=max(r.seconds for r in reports), megabytes=sum(r.bytes for r in reports) / 1e6
        )  # fmt: skip
    run_store = ObjectStore(ro.run.run_uri)
    batch = _batch_ref(ro, run_store.uri(BatchStore(run_store).key(ro.batch_index, Parts.ROLLOUT)), summary)
    s = summary.score
    scored = t.ScoreOutput(reward_mean=s.reward_mean, reward_std=s.reward_std, seconds=s.seconds, informative_groups=s.informative_groups)
    trained_out = t.TrainOutput(
        policy_version=trained.policy_version, metrics=dict(trained.metrics), seconds=seconds, kl_coef=trained.kl_coef,
        safe_lambda=trained.safe_lambda,
    )  # fmt: skip
    return batch, scored, trained_out, (ranks, replicas, synced)


@activity.defn(name="evaluate")
@temporal_errors
def evaluate(inp: t.EvalInput) -> t.EvalOutput:
    """Greedy answers on the fixed eval prompts, scored by the reward worker."""
    cfg = stored_run_config(inp.run.run_uri, inp.run.config_id)
    actors = actors_for(inp.run)
    gen = wait(actors.rollout(inp.policy_version).generate_eval.remote(inp.step, cfg.data.eval_size))
    out = actors.score(inp.step, RunLayout.EVALS)  # eval batches are stored by training step
    return t.EvalOutput(step=inp.step, reward_mean=out.reward_mean, num_samples=gen.num_samples)


@activity.defn(name="checkpoint")
@temporal_errors
def checkpoint(inp: t.CheckpointInput) -> t.CheckpointOutput:
    """Snapshot the trainer state; the ranks write, export and upload it in the background,
    and the manifest committed last makes it exist (workers/trainer.py)."""
    actors = actors_for(inp.run)
    ranks = actors.trainers(inp.policy_version)
    run_state = json.loads(PAYLOADS.to_payloads([inp.state])[0].data)
    # A background upload that failed is reported now, never dropped: this checkpoint is
    # then taken in the foreground, and the activity fails (and is retried) if it fails too.
    failed = _checkpoint_errors(wait([a.wait_checkpoint.remote() for a in ranks]))
    if failed:
        log.warning("run %s: %s; taking checkpoint step %d in the foreground", inp.run.run_id, failed, inp.step)
    # The critic's state goes from its actor to rank 0 directly (an ObjectRef, not via here).
    critic = actors.critic(inp.policy_version).state_files.remote() if actors.cfg.uses_critic else None
    outs = wait([a.start_checkpoint.remote(inp.step, run_state, critic if r == 0 else None, bool(failed)) for r, a in enumerate(ranks)])
    now_failed = _checkpoint_errors(outs)
    if now_failed:
        earlier = f" (after an earlier one: {failed})" if failed else ""
        raise CheckpointFailed(f"run {inp.run.run_id}: {now_failed}{earlier}")
    registry_calls.checkpoints_changed(inp.run)
    return t.CheckpointOutput(
        name=outs[0].name,
        stall_seconds=max(o.stall_seconds for o in outs),
        waited_seconds=max(o.waited_seconds for o in outs),
    )


def _checkpoint_errors(outs: list[CheckpointStarted | CheckpointOutcome]) -> str:
    """The failures the ranks report (every rank writes and uploads its own files; rank 0
    commits), as one text."""
    return "; ".join(dict.fromkeys(o.error for o in outs if o.error))


def settle_last_checkpoint(run_id: str, ranks: list) -> None:
    """A run must not complete without its last checkpoint: if it failed, take it again
    (the trainer still holds its version unless it trained on); if that fails too, fail
    the attempt: Temporal retries it, and then the run fails naming the checkpoint."""
    failed = _checkpoint_errors(wait([a.wait_checkpoint.remote() for a in ranks]))
    if not failed:
        return
    log.warning("run %s: %s; taking it again", run_id, failed)
    outs = wait([a.redo_checkpoint.remote() for a in ranks])
    again = _checkpoint_errors(outs)
    if again:
        # A retry cannot help once the trainer trained on: the failed state is gone.
        impossible = any(o.impossible for o in outs)
        raise CheckpointFailed(
            f"run {run_id}: {again}. The run has no committed checkpoint of its last state; check storage.root "
            "(space, permissions, the object store) and resume the run from its last good checkpoint",
            non_retryable=impossible,
        )


@activity.defn(name="record_step")
@temporal_errors
def record_step(inp: t.StepRecord) -> None:
    write_record(inp)


def write_record(inp: t.StepRecord) -> None:
    """A step's metrics line into metrics.jsonl, the trackers and the registry (each keyed by
    step: a retry rewrites it, never adds a second)."""
    MetricsLog(ObjectStore(inp.run.run_uri)).write(inp.step, inp.metrics)
    tracking_calls.step_recorded(inp)
    registry_calls.step_recorded(inp)


@activity.defn(name="finish_run")
@temporal_errors
def finish_run(inp: t.FinishInput) -> t.FinishOutput:
    """Export the final policy and release the run's actors."""
    cfg = stored_run_config(inp.run.run_uri, inp.run.config_id)
    actors = actors_for(inp.run)
    uri = ""
    ranks = actors.trainers(inp.policy_version)
    settle_last_checkpoint(inp.run.run_id, ranks)  # the last upload lands first
    if cfg.checkpoint.export_final:
        uri = wait([a.export.remote(RunLayout.FINAL_MODEL) for a in ranks])[0]
    registry_calls.run_finished(inp.run, cfg.loop.steps)
    killed = actors.shutdown()
    log.info("run %s finished; released %s", inp.run.run_id, ", ".join(killed))
    tracking_calls.run_finished(inp)
    return t.FinishOutput(final_policy_uri=uri)


@activity.defn(name="release_run")
@temporal_errors
def release_run(inp: t.ReleaseInput) -> t.ReleaseOutput:
    """Kill the run's actors, however the run ended (the workflow calls it on failure and
    cancellation too): a failed run must not keep its CPUs from the next one."""
    killed = release_run_actors(check_id(inp.run_id))
    tracking_calls.run_released(inp)
    registry_calls.run_released(inp)
    if killed:
        log.info("run %s: released %s", inp.run_id, ", ".join(killed))
    return t.ReleaseOutput(released=killed)


ALL_ACTIVITIES = [
    prepare_run, warmup, start_workers, generate, score, train, sync_weights, step, evaluate, checkpoint, record_step, finish_run,
    release_run, admit_run,
]  # fmt: skip
