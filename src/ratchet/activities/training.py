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
from ratchet.storage.batch_store import BatchStore
from ratchet.storage.metrics_log import MetricsLog
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.layout import RunLayout
from ratchet import types as t
from ratchet.ids import check_id
from ratchet.workers.actors import RunActors, release_run_actors
from ratchet.workers.actors.fused_step import StepRequest, fused_step
from ratchet.workers.background import BackgroundCall
from ratchet.workers.columns import Parts
from ratchet.workers.results import TrainResult

from . import registry_calls
from . import tracking_calls
from .admission import admit_run
from .run_config import stored_run_config
from .ray_calls import ACTIVITY_WAITER
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
    out = actors_for(inp.run).warm_up(cfg.model.path)
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
        actors.restart_at(inp.restore_version)
        return t.StartWorkersOutput(policy_version=inp.restore_version, num_parameters=0, seconds=time.perf_counter() - t0)
    n_params = actors.start(inp.policy_uri)
    return t.StartWorkersOutput(policy_version=0, num_parameters=n_params, seconds=time.perf_counter() - t0)


@activity.defn(name="generate")
@temporal_errors
def generate(inp: t.RolloutInput) -> t.BatchRef:
    actors = actors_for(inp.run)
    # Over the rollout replicas (workers/actors/rollout_group.py); one replica: as before.
    out = actors.rollout.generate(
        inp.batch_index, inp.prompt_start, inp.prompt_count, inp.policy_version, part=inp.part, exact=inp.exact_version
    )
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
    out = actors.reward.score(inp.batch.index, RunLayout.BATCHES, inp.batch.part)
    return t.ScoreOutput(
        reward_mean=out.reward_mean, reward_std=out.reward_std, seconds=out.seconds, informative_groups=out.informative_groups
    )


@activity.defn(name="train")
@temporal_errors
def train(inp: t.TrainInput) -> t.TrainOutput:
    """Policy update; with a critic (GAE), values first and the critic's own update after."""
    t0 = time.perf_counter()
    out = actors_for(inp.run).train(
        inp.batch.index, inp.policy_version, inp.kl_coef, inp.parts, live=inp.live or None, safe_lambda=inp.safe_lambda,
        retrying=activity.info().attempt > 1,
    )  # fmt: skip
    return _train_output(out, time.perf_counter() - t0)


def _train_output(out: TrainResult, seconds: float) -> t.TrainOutput:
    return t.TrainOutput(
        policy_version=out.policy_version, metrics=dict(out.metrics), seconds=seconds, kl_coef=out.kl_coef, safe_lambda=out.safe_lambda
    )


@activity.defn(name="sync_weights")
@temporal_errors
def sync_weights(inp: t.SyncInput) -> t.SyncOutput:
    t0 = time.perf_counter()
    out = actors_for(inp.run).sync_weights(inp.policy_version)
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
    done = fused_step(
        actors,
        StepRequest(
            batch_index=ro.batch_index, prompt_start=ro.prompt_start, prompt_count=ro.prompt_count, generation_version=ro.policy_version,
            policy_version=inp.policy_version, kl_coef=inp.kl_coef, part=ro.part, exact=ro.exact_version, live=inp.live or None,
            safe_lambda=inp.safe_lambda, next_prompt_start=inp.next_prompt_start, retrying=activity.info().attempt > 1,
        ),
    )  # fmt: skip
    run_store = ObjectStore(ro.run.run_uri)
    s = done.summary.score
    return t.StepOutput(
        batch=_batch_ref(ro, run_store.uri(BatchStore(run_store).key(ro.batch_index, Parts.ROLLOUT)), done.summary),
        score=t.ScoreOutput(reward_mean=s.reward_mean, reward_std=s.reward_std, seconds=s.seconds, informative_groups=s.informative_groups),
        trained=_train_output(done.trained, done.train_seconds),
        synced=t.SyncOutput(policy_version=done.synced.version, seconds=done.synced.seconds, megabytes=done.synced.bytes / 1e6),
    )


@activity.defn(name="evaluate")
@temporal_errors
def evaluate(inp: t.EvalInput) -> t.EvalOutput:
    """Greedy answers on the fixed eval prompts, scored by the reward worker."""
    cfg = stored_run_config(inp.run.run_uri, inp.run.config_id)
    generated, scored = actors_for(inp.run).evaluate(inp.step, cfg.data.eval_size, inp.policy_version)
    return t.EvalOutput(step=inp.step, reward_mean=scored.reward_mean, num_samples=generated.num_samples)


@activity.defn(name="checkpoint")
@temporal_errors
def checkpoint(inp: t.CheckpointInput) -> t.CheckpointOutput:
    """Snapshot the trainer state; the ranks write, export and upload it in the background,
    and the manifest committed last makes it exist (workers/trainer.py)."""
    run_state = json.loads(PAYLOADS.to_payloads([inp.state])[0].data)
    taken = actors_for(inp.run).checkpoint(inp.step, run_state, inp.policy_version)
    registry_calls.checkpoints_changed(inp.run)
    return t.CheckpointOutput(name=taken.name, stall_seconds=taken.stall_seconds, waited_seconds=taken.waited_seconds)


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
    uri = actors.trainer.finish(inp.policy_version, RunLayout.FINAL_MODEL if cfg.checkpoint.export_final else None)
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
