"""The controller at cluster scale, measured by simulation: 64 rollout replicas, 16 trainer ranks.

The real training workflow (sandboxed, as a worker runs it) on a real Temporal dev server,
with activities under the workflow's names that only sleep, as the real ones spend their
time: one `generate` fans out to every replica inside the activity
(workers/actors/rollout_pool.py), so it lasts as long as the slowest replica's share of the
batch; one `train` drives every rank in lockstep, so it lasts as long as the slowest rank's
share; each heartbeats every second with no details while it waits, as
activities/ray_calls.py does; the results carry what the real ones carry (the trainer's
metrics are reduced over the ranks, one dict whatever the world size). The stand-ins are
async activities: what is measured is Temporal's part, not the worker's thread pool.
Prints, per loop mode:

1. the achieved seconds per step against the ideal (the same sleeps with free
   orchestration), the overhead in ms and %, Temporal history events and bytes per step,
   workflow tasks, server requests and heartbeats per step, and what a `progress` query
   costs while the run is watched (every 0.5 s, as `RunHandle.follow` polls);
   and, for contrast, the same sync step made of per-replica and per-rank activities
   (not how ratchet calls them);
2. continue-as-new at work: a second dev server told to suggest it after a few hundred
   events (instead of 4,096), short sleeps, the run followed segment by segment: every
   segment's history stays under the threshold plus about two steps (a step crosses it;
   fully_async then lets the batch in flight finish), and the state carried is the same
   size in every segment;
3. a 100,000-step run projected from those numbers: steps per segment at Temporal's
   default threshold, the longest history any segment reaches, the run state's payload
   at step 100,000 (built with RunState's own methods: 100,000 rewards, an evaluation
   every 10 steps, a full fully_async queue), the TrainingInput carried at each
   continue-as-new, and what a query on a run not in the worker's cache costs (it replays
   the segment's history; measured with the SDK's Replayer).

    .venv/bin/python benchmarks/scale.py                  # 10 s steps, about 4 minutes
    .venv/bin/python benchmarks/scale.py --step-seconds 1 --steps 5 --skip-per-replica   # about 40 s

tests/faults/test_scale.py runs the same simulation with no sleeps and checks what must
hold at any scale (events per step independent of replicas and ranks, bounded segments,
a bounded run state).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.converter import default as default_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, UnsandboxedWorkflowRunner, Worker

from ratchet import types as t
from ratchet.admission_types import AdmitInput, AdmitOutput
from ratchet.config import load_config
from ratchet.config.loop_plan import loop_plan
from ratchet.workflows import search_attributes as sa
from ratchet.workflows.training import TrainingWorkflow

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "copy_grpo.yaml"
TEMPORAL = Path(sys.executable).parent / "temporal"
PAYLOADS = default_converter().payload_converter

HEARTBEAT_EVERY_S = 1.0  # activities/ray_calls.POLL_SECONDS: a heartbeat per poll of Ray, details None
DEFAULT_SUGGEST_EVENTS = 4096  # Temporal's limit.historyCount.suggestContinueAsNew (measured: suggested at 4,140)
HARD_LIMIT_EVENTS = 51_200  # Temporal terminates a workflow run whose history reaches this
MODES = {
    "sync": ["loop.mode=sync"],
    "one_step_off": ["loop.mode=one_step_off"],
    # As benchmarks/async_speedup.py: two versions ahead, so generation never waits for the trainer.
    "fully_async": ["loop.mode=fully_async", "loop.max_staleness=2", "loop.queue_limit=3"],
}

# What TrainerWorker.train reports (workers/policy_update.py, trainer.py): sums reduced over
# the ranks, so one dict of this size at any world size.
TRAIN_METRIC_KEYS = (
    "pg_loss", "entropy", "clip_frac", "logprob_diff", "kl", "grad_norm", "adv_abs_mean", "response_length",
    "kl_coef", "kept_fraction", "staleness_tokens/0", "staleness_tokens/1", "staleness_tokens/max",
    "off_policy/ratio_mean", "off_policy/ratio_max", "off_policy/masked_fraction", "train_seconds", "lr",
)  # fmt: skip


@dataclass(frozen=True)
class Workload:
    """One simulated step. A sync step's work is `step_seconds`: generate 50% (the slowest
    replica's share of the batch), score 5%, train 40% (the slowest rank's share; the ranks
    wait for each other in every collective), weight sync 5%."""

    replicas: int = 64
    ranks: int = 16
    prompts_per_replica: int = 4
    samples_per_prompt: int = 8
    step_seconds: float = 10.0

    @property
    def prompts(self) -> int:
        return self.replicas * self.prompts_per_replica

    def shares(self, count: int, workers: int) -> list[int]:
        """`count` items over `workers` idle workers as rollout_pool.split_by_load spreads
        them (water filling; equal loads: as even as whole items allow)."""
        return [count // workers + (1 if i < count % workers else 0) for i in range(workers)]

    @property
    def generate_s(self) -> float:
        per_prompt = 0.5 * self.step_seconds / self.prompts_per_replica
        return max(self.shares(self.prompts, self.replicas)) * per_prompt

    @property
    def train_s(self) -> float:
        samples = self.prompts * self.samples_per_prompt
        per_sample = 0.4 * self.step_seconds / (samples / self.ranks)
        return max(self.shares(samples, self.ranks)) * per_sample

    @property
    def score_s(self) -> float:
        return 0.05 * self.step_seconds

    @property
    def sync_s(self) -> float:
        return 0.05 * self.step_seconds

    def ideal(self, mode: str) -> float:
        """Seconds per step with free orchestration, from each loop's schedule
        (workflows/training/loops/): sync runs the four in order; one_step_off trains step n
        while batch n+1 is generated and scored, then syncs; fully_async with partial
        rollouts generates back to back while the trainer keeps up (the sync overlaps the
        next update), so the slower of generate and train sets the pace."""
        g, c, tr, w = self.generate_s, self.score_s, self.train_s, self.sync_s
        return {"sync": g + c + tr + w, "one_step_off": max(tr, g + c) + w, "fully_async": max(g, tr)}[mode]

    def config(self, mode: str, steps: int) -> dict[str, Any]:
        """The run config a user would submit at this scale, as the client stores it."""
        cfg = load_config(
            RECIPE,
            [
                *MODES[mode], f"loop.steps={steps}", f"loop.prompts_per_step={self.prompts}", f"rollout.n={self.samples_per_prompt}",
                f"rollout.replicas={self.replicas}", f"trainer.world_size={self.ranks}", "data.eval_files=null", "checkpoint.every=0",
                "tracking.experiment=scale",
            ],
            check_files=False,
        )  # fmt: skip
        return cfg.model_dump(mode="json")


# -- activities that only sleep -----------------------------------------------------------


class Simulation:
    """The workflow's activities as sleeps of `workload`'s lengths, heartbeating every second."""

    def __init__(self, workload: Workload):
        self.w = workload
        self.heartbeats = 0
        self.recorded: list[tuple[int, float]] = []  # (step, perf_counter) per metrics line
        self.on_record = None  # called with the step number (in a thread) when its line is written

    async def _busy(self, seconds: float) -> None:
        """Wait as ray_calls.wait does: poll, heartbeat, poll again."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            await asyncio.sleep(min(HEARTBEAT_EVERY_S, left))
            activity.heartbeat()
            self.heartbeats += 1

    def _batch(self, inp: t.RolloutInput) -> t.BatchRef:
        samples = inp.prompt_count * self.w.samples_per_prompt
        return t.BatchRef(
            run_id=inp.run.run_id, index=inp.batch_index, uri=f"{inp.run.run_uri}/batches/step-{inp.batch_index:06d}/rollout.safetensors",
            num_prompts=inp.prompt_count, num_samples=samples, num_response_tokens=samples * 187, policy_version=inp.policy_version,
            part=inp.part, prompt_start=inp.prompt_start, generate_seconds=self.w.generate_s, response_length_mean=187.25,
        )  # fmt: skip

    def _trained(self, policy_version: int, kl_coef: float) -> t.TrainOutput:
        metrics = {k: 0.123456789 * (i + 1) for i, k in enumerate(TRAIN_METRIC_KEYS)}
        return t.TrainOutput(policy_version=policy_version + 1, metrics=metrics, seconds=self.w.train_s, kl_coef=kl_coef)

    def _score(self, batch: t.BatchRef) -> t.ScoreOutput:
        return t.ScoreOutput(
            reward_mean=0.4321 + 1e-4 * batch.index, reward_std=0.2468, seconds=self.w.score_s, informative_groups=batch.num_prompts
        )

    def _synced(self, version: int) -> t.SyncOutput:
        return t.SyncOutput(policy_version=version, seconds=self.w.sync_s, megabytes=988.4)

    def activities(self) -> list:
        w = self

        async def prepare_run(inp: t.PrepareInput) -> t.PrepareOutput:
            return t.PrepareOutput(run=t.RunRef(inp.run_id, f"s3://ratchet-runs/runs/{inp.run_id}", "0f3a9c2b71d48e65"))

        async def admit_run(inp: AdmitInput) -> AdmitOutput:
            return AdmitOutput(admitted=True)  # the simulated cluster always has room

        async def warmup(inp: t.WarmupInput) -> t.WarmupOutput:
            return t.WarmupOutput(policy_uri=f"{inp.run.run_uri}/warmup/model", loss_first=2.5, loss_last=0.7, seconds=0.0)

        async def start_workers(inp: t.StartWorkersInput) -> t.StartWorkersOutput:
            return t.StartWorkersOutput(policy_version=inp.restore_version or 0, num_parameters=7_615_616_512, seconds=0.0)

        async def generate(inp: t.RolloutInput) -> t.BatchRef:
            await w._busy(w.w.generate_s)
            return w._batch(inp)

        async def score(inp: t.ScoreInput) -> t.ScoreOutput:
            await w._busy(w.w.score_s)
            return w._score(inp.batch)

        async def train(inp: t.TrainInput) -> t.TrainOutput:
            await w._busy(w.w.train_s)
            return w._trained(inp.policy_version, inp.kl_coef)

        async def sync_weights(inp: t.SyncInput) -> t.SyncOutput:
            await w._busy(w.w.sync_s)
            return w._synced(inp.policy_version)

        async def step(inp: t.StepInput) -> t.StepOutput:
            # Sync mode's fused step: the four phases inside one activity (activities/training.py).
            await w._busy(w.w.generate_s + w.w.score_s + w.w.train_s + w.w.sync_s)
            batch = w._batch(inp.rollout)
            trained = w._trained(inp.policy_version, inp.kl_coef)
            return t.StepOutput(batch=batch, score=w._score(batch), trained=trained, synced=w._synced(trained.policy_version))

        async def evaluate(inp: t.EvalInput) -> t.EvalOutput:
            return t.EvalOutput(step=inp.step, reward_mean=0.5, num_samples=256)

        async def checkpoint(inp: t.CheckpointInput) -> t.CheckpointOutput:
            return t.CheckpointOutput(name=f"step-{inp.step:08d}", stall_seconds=0.0, waited_seconds=0.0)

        async def record_step(inp: t.StepRecord) -> None:
            w.recorded.append((inp.step, time.perf_counter()))
            if w.on_record is not None:
                await asyncio.to_thread(w.on_record, inp.step)

        async def finish_run(inp: t.FinishInput) -> t.FinishOutput:
            return t.FinishOutput(final_policy_uri=f"{inp.run.run_uri}/final/model")

        async def release_run(inp: t.ReleaseInput) -> t.ReleaseOutput:
            return t.ReleaseOutput()

        fns = [prepare_run, admit_run, warmup, start_workers, generate, score, train, sync_weights, step, evaluate, checkpoint, record_step,
               finish_run, release_run]  # fmt: skip
        return [activity.defn(name=fn.__name__)(fn) for fn in fns]


# -- what a run's history says ------------------------------------------------------------


def _is_step_marker(e) -> bool:
    """A metrics line, one per step: the `record_step` local activity's marker, or (sync
    mode) a `step` activity scheduled with the previous step's line in its input."""
    if e.HasField("marker_recorded_event_attributes"):
        return e.marker_recorded_event_attributes.marker_name == "core_local_activity"
    if e.HasField("activity_task_scheduled_event_attributes"):
        scheduled = e.activity_task_scheduled_event_attributes
        if scheduled.activity_type.name == "step" and scheduled.input.payloads:
            return json.loads(scheduled.input.payloads[0].data).get("record") is not None
    return False


@dataclass
class Segment:
    """One workflow run of a run's chain (continue-as-new starts the next)."""

    run_id: str
    events: int
    bytes: int
    steps: int  # metrics lines recorded in it
    steady_events: list[int]  # event counts between consecutive metrics lines
    steady_bytes: list[int]
    steady_tasks: list[int]  # workflow tasks completed between them
    steady_activities: list[int]  # activities scheduled between them
    activities: dict[str, int] = field(default_factory=dict)  # activities scheduled, by name
    activity_bytes: int = 0  # their scheduled and completed events (inputs, outputs, summaries)
    carried_bytes: int = 0  # the TrainingInput its continue-as-new carries (0: the last run)
    state_bytes: int = 0  # ... of which the RunState
    suggested_at: int = 0  # history length when the workflow continued as new


def read_segment(history) -> Segment:
    events = list(history.events)
    marks = [i for i, e in enumerate(events) if _is_step_marker(e)]
    sizes = [e.ByteSize() for e in events]
    seg = Segment(
        run_id=history.run_id, events=len(events), bytes=sum(sizes), steps=len(marks),
        steady_events=[b - a for a, b in zip(marks, marks[1:])],
        steady_bytes=[sum(sizes[a + 1 : b + 1]) for a, b in zip(marks, marks[1:])],
        steady_tasks=[sum(e.HasField("workflow_task_completed_event_attributes") for e in events[a + 1 : b + 1]) for a, b in zip(marks, marks[1:])],
        steady_activities=[sum(e.HasField("activity_task_scheduled_event_attributes") for e in events[a + 1 : b + 1]) for a, b in zip(marks, marks[1:])],
    )  # fmt: skip
    if events[-1].HasField("workflow_execution_completed_event_attributes") and seg.steady_events:
        # The run's last step drains the pipeline (no next batch): not a steady step.
        for steady in (seg.steady_events, seg.steady_bytes, seg.steady_tasks, seg.steady_activities):
            steady.pop()
    for e, size in zip(events, sizes):
        if e.HasField("activity_task_scheduled_event_attributes"):
            name = e.activity_task_scheduled_event_attributes.activity_type.name
            seg.activities[name] = seg.activities.get(name, 0) + 1
            seg.activity_bytes += size
        elif e.HasField("activity_task_completed_event_attributes"):
            seg.activity_bytes += size
    last = events[-1]
    if last.HasField("workflow_execution_continued_as_new_event_attributes"):
        payload = last.workflow_execution_continued_as_new_event_attributes.input.payloads[0]
        seg.carried_bytes = payload.ByteSize()
        seg.state_bytes = len(json.dumps(json.loads(payload.data)["resume"], separators=(",", ":")))
        seg.suggested_at = len(events)
    return seg


async def run_chain(client: Client, workflow_id: str, run_id: str) -> list[Segment]:
    """Every workflow run of `workflow_id` from `run_id` on, following continue-as-new."""
    segments = []
    while run_id:
        history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        segments.append(read_segment(history))
        last = history.events[-1]
        run_id = last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id if last.HasField(
            "workflow_execution_continued_as_new_event_attributes") else ""  # fmt: skip
    return segments


def server_requests(metrics_port: int) -> dict[str, float]:
    """Requests the dev server's frontend has answered, by operation (its Prometheus counters)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("service_latency_count{") and 'service_name="frontend"' in line:
            op = line.split('operation="', 1)[1].split('"', 1)[0]
            out[op] = out.get(op, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def steady_step_seconds(recorded: list[tuple[int, float]]) -> float | None:
    """Seconds per step between the metrics lines of the first and the last-but-one step:
    the first step fills the pipeline (nothing to overlap yet), the last drains it (no next
    batch to generate), so neither runs at the steady pace the ideal describes."""
    times = [tm for _, tm in sorted(recorded)]
    if len(times) < 3:
        return None
    return (times[-2] - times[0]) / (len(times) - 2)


@dataclass
class ModeResult:
    mode: str
    steps: int
    ideal_s: float
    step_s: float | None  # steady state (steady_step_seconds)
    segments: list[Segment]
    heartbeats_per_step: float = 0.0
    requests_per_step: dict[str, float] = field(default_factory=dict)
    query_ms: list[float] = field(default_factory=list)
    cold_query_ms: float | None = None  # a query after the run ended: the worker replays its history

    def activities(self) -> dict[str, int]:
        """Activities the whole run scheduled, by name (every segment)."""
        out: dict[str, int] = {}
        for seg in self.segments:
            for name, n in seg.activities.items():
                out[name] = out.get(name, 0) + n
        return out

    def per_step(self, attr: str) -> float:
        # The median interval: the first step's also holds the start's extra upsert.
        xs = [x for s in self.segments for x in getattr(s, attr)]
        return statistics.median(xs) if xs else float("nan")

    @property
    def overhead_s(self) -> float | None:
        return None if self.step_s is None else self.step_s - self.ideal_s


async def run_mode(
    client: Client,
    mode: str,
    workload: Workload,
    steps: int,
    *,
    run_id: str,
    metrics_port: int | None = None,
    query_every_s: float | None = None,
    search_attributes: bool = False,
    continue_as_new_every: int = 0,
    cold_query: bool = False,
) -> ModeResult:
    """One run of the real TrainingWorkflow with the sleeping activities, to its end."""
    sim = Simulation(workload)
    marks: dict[int, tuple[float, dict[str, float], int]] = {}
    if metrics_port is not None:
        # Server requests and heartbeats between the first and the last-but-one metrics line only.
        def on_record(step: int) -> None:
            if step in (0, steps - 2):
                marks[step] = (time.perf_counter(), server_requests(metrics_port), sim.heartbeats)

        sim.on_record = on_record
    cfg = workload.config(mode, steps)
    plan = replace(loop_plan(load_config(None, [], base=cfg, check_files=False)), continue_as_new_every=continue_as_new_every)
    inp = t.TrainingInput(run_id=run_id, config=cfg, plan=plan, search_attributes=search_attributes)
    queue = f"scale-{run_id}"
    query_ms: list[float] = []
    async with Worker(client, task_queue=queue, workflows=[TrainingWorkflow], activities=sim.activities(),
                      graceful_shutdown_timeout=timedelta(seconds=1)):  # fmt: skip
        extra = {"search_attributes": sa.initial_attributes(cfg)} if search_attributes else {}
        handle = await client.start_workflow("TrainingWorkflow", inp, id=run_id, task_queue=queue, result_type=t.RunSummary, **extra)
        if query_every_s:
            # Watched as `RunHandle.follow` watches: a progress query every `query_every_s`.
            # A query is answered by the worker from its cached workflow and adds no event.
            async def watch() -> None:
                while True:
                    await asyncio.sleep(query_every_s)
                    t0 = time.perf_counter()
                    await handle.query("progress", result_type=t.Progress)
                    query_ms.append((time.perf_counter() - t0) * 1000)

            watcher = asyncio.ensure_future(watch())
        try:
            summary = await handle.result()
        finally:
            if query_every_s:
                watcher.cancel()
        cold_ms = None
        if cold_query:
            # A closed run is in no worker's cache: the worker replays its history to answer.
            t0 = time.perf_counter()
            await handle.query("progress", result_type=t.Progress)
            cold_ms = (time.perf_counter() - t0) * 1000
    assert summary.steps == steps, summary
    segments = await run_chain(client, run_id, handle.first_execution_run_id or handle.run_id)
    result = ModeResult(
        mode, steps, workload.ideal(mode), steady_step_seconds(sim.recorded), segments,
        query_ms=query_ms, cold_query_ms=cold_ms,
    )  # fmt: skip
    if 0 in marks and steps - 2 in marks and steps > 2:  # the steady steps, as steady_step_seconds
        (_, r0, h0), (_, r1, h1) = marks[0], marks[steps - 2]
        result.requests_per_step = {op: (r1.get(op, 0.0) - r0.get(op, 0.0)) / (steps - 2) for op in r1}
        result.heartbeats_per_step = (h1 - h0) / (steps - 2)
    return result


# -- the counterfactual: per-replica and per-rank activities -------------------------------


@workflow.defn(name="PerReplicaSyncSteps", sandboxed=False)
class PerReplicaSyncSteps:
    """Sync mode's step as a controller that called every replica and rank itself would
    make it: one activity per replica to generate, one to score, one per rank to train, one
    per replica to sync; then the metrics line. Not ratchet's design: here to measure it."""

    @workflow.run
    async def run(self, args: list) -> int:
        steps, replicas, ranks, heartbeat_s = args
        opts = dict(start_to_close_timeout=timedelta(minutes=30), heartbeat_timeout=timedelta(seconds=heartbeat_s))
        for step in range(steps):
            await asyncio.gather(*(workflow.execute_activity("replica_generate", r, **opts) for r in range(replicas)))
            await workflow.execute_activity("score_all", step, **opts)
            await asyncio.gather(*(workflow.execute_activity("rank_train", r, **opts) for r in range(ranks)))
            await asyncio.gather(*(workflow.execute_activity("replica_sync", r, **opts) for r in range(replicas)))
            await workflow.execute_local_activity(
                "record_step", t.StepRecord(t.RunRef("x", "x"), step, {}), start_to_close_timeout=timedelta(minutes=1)
            )
        return steps


async def run_per_replica(client: Client, workload: Workload, steps: int, metrics_port: int | None) -> ModeResult:
    sim = Simulation(workload)
    w = workload
    marks: dict[int, tuple[dict[str, float], int]] = {}

    async def replica_generate(replica: int) -> t.BatchRef:
        await sim._busy(w.generate_s)
        share = w.shares(w.prompts, w.replicas)[replica]
        return sim._batch(t.RolloutInput(t.RunRef("sim", "s3://ratchet-runs/runs/sim"), 0, replica * share, share, 0))

    async def score_all(step: int) -> t.ScoreOutput:
        await sim._busy(w.score_s)
        return t.ScoreOutput(0.43, 0.25, w.score_s, w.prompts)

    async def rank_train(rank: int) -> t.TrainOutput:
        await sim._busy(w.train_s)
        return sim._trained(0, 0.0)

    async def replica_sync(replica: int) -> t.SyncOutput:
        await sim._busy(w.sync_s)
        return sim._synced(1)

    async def record_step(inp: t.StepRecord) -> None:
        sim.recorded.append((inp.step, time.perf_counter()))
        if metrics_port is not None and inp.step in (0, steps - 2):
            marks[inp.step] = (await asyncio.to_thread(server_requests, metrics_port), sim.heartbeats)

    acts = [activity.defn(name=f.__name__)(f) for f in (replica_generate, score_all, rank_train, replica_sync, record_step)]
    run_id = f"per-replica-{time.time_ns()}"
    async with Worker(client, task_queue=run_id, workflows=[PerReplicaSyncSteps], activities=acts,
                      workflow_runner=UnsandboxedWorkflowRunner(), max_concurrent_activities=2 * (w.replicas + w.ranks),
                      graceful_shutdown_timeout=timedelta(seconds=1)):  # fmt: skip
        await client.execute_workflow("PerReplicaSyncSteps", [steps, w.replicas, w.ranks, 30.0], id=run_id, task_queue=run_id)
    seg = read_segment(await client.get_workflow_handle(run_id).fetch_history())
    result = ModeResult("sync, per-replica activities", steps, w.ideal("sync"), steady_step_seconds(sim.recorded), [seg])
    if 0 in marks and steps - 2 in marks and steps > 2:
        (r0, h0), (r1, h1) = marks[0], marks[steps - 2]
        result.requests_per_step = {op: (r1.get(op, 0.0) - r0.get(op, 0.0)) / (steps - 2) for op in r1}
        result.heartbeats_per_step = (h1 - h0) / (steps - 2)
    return result


# -- the run state after 100,000 steps ---------------------------------------------------


def payload_bytes(value: Any) -> int:
    """Bytes of `value` as Temporal carries it (the default converter's JSON)."""
    return PAYLOADS.to_payloads([value])[0].ByteSize()


def state_at(steps: int, workload: Workload, *, queue_limit: int = 3, eval_every: int = 10) -> t.RunState:
    """The run state after `steps` steps, grown with RunState's own methods: every step's
    reward recorded, an evaluation every `eval_every` steps, a live change, and the fullest
    fully_async moment (`queue_limit` scored batches waiting, one dropped batch's prompts
    queued again)."""
    run = t.RunRef(f"scale-{steps}", f"s3://ratchet-runs/runs/scale-{steps}", "0f3a9c2b71d48e65")
    state = t.RunState(run=run, next_step=steps, next_batch=steps + queue_limit + 1, policy_version=steps, rollout_version=steps - 1,
                       kl_coef=0.001, warmup_loss_first=2.5, warmup_loss_last=0.7)  # fmt: skip
    state.next_prompt = (steps + queue_limit + 1) * workload.prompts
    for step in range(steps):
        state.record_reward(((step * 7919) % 1000) / 997.0)
        if step % eval_every == 0:
            state.record_eval(step, ((step * 104729) % 1000) / 991.0)
    sim = Simulation(workload)
    for k in range(queue_limit):
        index = steps + k
        batch = sim._batch(t.RolloutInput(run, index, index * workload.prompts, workload.prompts, steps - 1))
        state.ready.append([t.ScoredBatch(batch, sim._score(batch))])
    state.retry_prompts = [(steps - 3) * workload.prompts]
    state.dropped_samples = workload.prompts * workload.samples_per_prompt
    state.live.values = {"algorithm.kl.coef": 0.001, "trainer.lr": 1e-6}
    state.live.changes, state.live.last_step = 2, steps - 500
    return state


def carried_input(state: t.RunState, workload: Workload, mode: str = "fully_async") -> t.TrainingInput:
    """What a continue-as-new carries: the run's config and plan, and the state."""
    cfg = workload.config(mode, 100_000)
    return t.TrainingInput(run_id=state.run.run_id, config=cfg, plan=loop_plan(load_config(None, [], base=cfg, check_files=False)),
                           resume=state, search_attributes=True)  # fmt: skip


async def replay_cost(histories: list) -> tuple[float, float]:
    """What replaying a history costs (a query or a workflow task for a run not in the
    worker's cache, e.g. after a worker restart, replays the run's whole history): a fixed
    part (the sandbox, the workflow's imports) and a part per event, fitted by least
    squares over `histories` of different lengths. (ms, ms per 1,000 events)."""
    replayer = Replayer(workflows=[TrainingWorkflow])
    points = []
    for h in histories:
        t0 = time.perf_counter()
        await replayer.replay_workflow(h)
        points.append((len(h.events), (time.perf_counter() - t0) * 1000))
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in points) / max(sum((x - mx) ** 2 for x in xs), 1e-9)
    return max(0.0, my - slope * mx), slope * 1000


# -- the benchmark --------------------------------------------------------------------------


async def measure(args) -> dict:
    from ratchet.platform.services import free_ports

    out: dict[str, Any] = {}
    w = Workload(replicas=args.replicas, ranks=args.ranks, step_seconds=args.step_seconds)
    (metrics_port,) = free_ports(1)
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(TEMPORAL), ui=False, search_attributes=list(sa.ALL_KEYS),
        dev_server_extra_args=["--metrics-port", str(metrics_port)],
    )  # fmt: skip
    try:
        out["modes"] = []
        for mode in MODES:
            r = await run_mode(env.client, mode, w, args.steps, run_id=f"scale-{mode}-{time.time_ns()}", metrics_port=metrics_port,
                               query_every_s=0.5, search_attributes=True)  # fmt: skip
            out["modes"].append(r)
            print(f"  {mode}: {r.step_s:.3f} s/step (ideal {r.ideal_s:.3f})", flush=True)
        # A long segment for the cost of replaying one (no sleeps: only its length matters).
        run_id = f"replay-sync-{time.time_ns()}"
        r = await run_mode(env.client, "sync", replace(w, step_seconds=0.0), args.replay_steps, run_id=run_id, search_attributes=True,
                           cold_query=True)  # fmt: skip
        out["replay_run"] = r
        out["replay_histories"] = [await env.client.get_workflow_handle(run_id).fetch_history()]
        print(f"  a {r.segments[0].events}-event run: a query once it ended took {r.cold_query_ms:.0f} ms", flush=True)
        if not args.skip_per_replica:
            r = await run_per_replica(env.client, w, max(4, args.steps // 2), metrics_port)
            out["per_replica"] = r
            print(f"  per-replica activities: {r.step_s:.3f} s/step (ideal {r.ideal_s:.3f})", flush=True)
    finally:
        await env.shutdown()

    # Continue-as-new, on a server that suggests it early; short sleeps, same shape.
    short = replace(w, step_seconds=args.can_step_seconds)
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(TEMPORAL), ui=False, search_attributes=list(sa.ALL_KEYS),
        dev_server_extra_args=["--dynamic-config-value", f"limit.historyCount.suggestContinueAsNew={args.suggest_events}"],
    )  # fmt: skip
    try:
        out["chains"] = []
        histories = []
        for mode in MODES:
            run_id = f"chain-{mode}-{time.time_ns()}"
            r = await run_mode(env.client, mode, short, args.can_steps, run_id=run_id, search_attributes=True)
            out["chains"].append(r)
            print(f"  {mode}: {args.can_steps} steps in {len(r.segments)} segments", flush=True)
            for seg in r.segments:
                histories.append(await env.client.get_workflow_handle(run_id, run_id=seg.run_id).fetch_history())
        out["replay_fixed_ms"], out["replay_ms_per_kevent"] = await replay_cost([*histories, *out.pop("replay_histories")])
    finally:
        await env.shutdown()
    state = state_at(100_000, w)
    out["state_bytes"] = payload_bytes(state)
    out["state_bytes_step0"] = payload_bytes(t.RunState(run=state.run))
    out["input_bytes"] = payload_bytes(carried_input(state, w))
    out["input_bytes_1x1"] = payload_bytes(carried_input(state_at(100_000, Workload(1, 1, step_seconds=w.step_seconds)), Workload(1, 1)))
    return out


def report(args, out: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    w = Workload(replicas=args.replicas, ranks=args.ranks, step_seconds=args.step_seconds)
    title = (f"{w.replicas} rollout replicas x {w.ranks} trainer ranks, {w.prompts} prompts x {w.samples_per_prompt} samples a step; "
             f"a sync step's work {w.step_seconds:g} s (generate {w.generate_s:g}, score {w.score_s:g}, train {w.train_s:g}, "
             f"sync {w.sync_s:g}); {args.steps} steps per mode, watched by a progress query every 0.5 s")  # fmt: skip
    tab = Table(title=title)
    cols = ("mode", "ideal s/step", "s/step", "overhead ms/step", "overhead", "events/step", "KB/step", "wf tasks/step",
            "server requests/step", "heartbeats sent/step", "heartbeat requests/step", "query ms (p50)")  # fmt: skip
    for col in cols:
        tab.add_column(col, justify="right")
    rows = [*out["modes"], *([out["per_replica"]] if "per_replica" in out else [])]
    for r in rows:
        req = r.requests_per_step
        tab.add_row(
            r.mode, f"{r.ideal_s:.3f}", f"{r.step_s:.3f}", f"{r.overhead_s * 1000:.0f}", f"{r.overhead_s / r.ideal_s * 100:+.2f}%",
            f"{r.per_step('steady_events'):.1f}", f"{r.per_step('steady_bytes') / 1000:.2f}", f"{r.per_step('steady_tasks'):.1f}",
            f"{sum(v for k, v in req.items() if not k.startswith('Poll') and 'Query' not in k):.1f}" if req else "-",
            f"{r.heartbeats_per_step:.1f}", f"{req.get('RecordActivityTaskHeartbeat', 0.0):.2f}" if req else "-",
            f"{statistics.median(r.query_ms):.1f}" if r.query_ms else "-",
        )  # fmt: skip
    console.print(tab)

    # Each activity is 3 events (scheduled, started, completed), each workflow task 3, plus the
    # metrics line's marker and the search-attribute upsert: anything else would show here.
    def typical(r: ModeResult) -> str:  # the commonest step's events, activities, workflow tasks
        steps = Counter((e, a, w) for s in r.segments for e, a, w in zip(s.steady_events, s.steady_activities, s.steady_tasks))
        (e, a, w), _ = steps.most_common(1)[0]
        return f"{r.mode} {e} = 3 x {a} + 3 x {w} + 2"

    account = ", ".join(typical(r) for r in out["modes"])
    console.print(
        "server requests/step: the frontend's answered requests in the steady steps (long polls and the queries' own "
        "requests left out); heartbeats sent: activity.heartbeat() calls, which the SDK sends on as one request per activity "
        "and then at most one per 0.8 x the heartbeat timeout (30 s). Events a step = 3 x activities + 3 x workflow tasks + "
        f"a metrics line + an upsert ({account}): no heartbeat and no query is in the history."
    )  # fmt: skip

    tab = Table(title=f"continue-as-new: a server that suggests it at {args.suggest_events} events (default {DEFAULT_SUGGEST_EVENTS}), "
                      f"{args.can_steps} steps per mode with {args.can_step_seconds:g} s steps")  # fmt: skip
    for col in ("mode", "segments", "steps per segment", "events per segment (max)", "threshold + 2 steps", "KB per segment (max)",
                "continued at (events)", "carried input bytes", "run state bytes (first, last)"):  # fmt: skip
        tab.add_column(col, justify="right")
    for r in out["chains"]:
        segs = r.segments
        carried = [s for s in segs if s.carried_bytes]
        per_step = max(max(s.steady_events, default=0) for s in segs)
        tab.add_row(
            r.mode, str(len(segs)), ", ".join(str(s.steps) for s in segs), str(max(s.events for s in segs)),
            str(args.suggest_events + 2 * per_step), f"{max(s.bytes for s in segs) / 1000:.1f}",
            ", ".join(str(s.suggested_at) for s in carried) or "-",
            f"{min(s.carried_bytes for s in carried)}-{max(s.carried_bytes for s in carried)}" if carried else "-",
            f"{carried[0].state_bytes}, {carried[-1].state_bytes}" if carried else "-",
        )  # fmt: skip
    console.print(tab)

    tab = Table(title="a 100,000-step run, projected from the measured events and bytes per step")
    for col in ("mode", "events/step", "steps per segment", "segments", "longest segment (events)", "longest segment (MB)",
                "without continue-as-new: events", "run stops at step", "cold query (replay) ms"):  # fmt: skip
        tab.add_column(col, justify="right")
    for r in out["modes"]:
        ev, by = r.per_step("steady_events"), r.per_step("steady_bytes")
        start = max(0, r.segments[0].events - ev * r.segments[0].steps)  # events outside the steps (start, end)
        per_segment = math.floor((DEFAULT_SUGGEST_EVENTS - start) / ev) + 1
        longest = start + ev * per_segment
        tab.add_row(
            r.mode, f"{ev:.1f}", str(per_segment), f"{math.ceil(100_000 / per_segment):,}", f"{longest:,.0f}",
            f"{(longest * by / ev) / 1e6:.2f}", f"{100_000 * ev:,.0f}", f"{int((HARD_LIMIT_EVENTS - start) / ev):,}",
            f"{out['replay_fixed_ms'] + out['replay_ms_per_kevent'] * longest / 1000:.0f}",
        )  # fmt: skip
    console.print(tab)
    console.print(
        f"run state payload at step 100,000 (100,000 rewards, an evaluation every 10 steps, a full queue of 3 batches): "
        f"{out['state_bytes']:,} bytes (at step 0: {out['state_bytes_step0']:,}); the TrainingInput a continue-as-new "
        f"carries (config, plan, state): {out['input_bytes']:,} bytes at {w.replicas} x {w.ranks}, "
        f"{out['input_bytes_1x1']:,} at 1 x 1 (Temporal's payload limit: 2,097,152)."
    )
    rr = out["replay_run"]
    console.print(
        f"replaying a history (a query or a workflow task for a run not in the worker's cache): {out['replay_fixed_ms']:.0f} ms "
        f"+ {out['replay_ms_per_kevent']:.0f} ms per 1,000 events (Replayer, fitted over {len(out['chains'])} modes' segments and "
        f"a {rr.segments[0].events}-event run); a progress query on that run once it had ended (the worker replays it): "
        f"{rr.cold_query_ms:.0f} ms; on a running, cached run: the p50 above."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=7, help="steps per mode in the timed runs (the first and last are left out)")
    ap.add_argument("--step-seconds", type=float, default=10.0, help="a sync step's simulated work")
    ap.add_argument("--replicas", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--skip-per-replica", action="store_true", help="leave out the per-replica-activities contrast")
    ap.add_argument("--can-steps", type=int, default=40, help="steps per mode in the continue-as-new runs")
    ap.add_argument("--can-step-seconds", type=float, default=0.05, help="a sync step's work in the continue-as-new runs")
    ap.add_argument("--replay-steps", type=int, default=200, help="steps of the run whose history is replayed (no sleeps)")
    ap.add_argument("--suggest-events", type=int, default=150, help="history length at which that server suggests continue-as-new")
    args = ap.parse_args()
    if args.steps < 4:
        ap.error("--steps must be at least 4 (the first step fills the pipeline and the last drains it: both are left out)")
    out = asyncio.run(measure(args))
    report(args, out)
    sys.stdout.flush()
    os._exit(0)  # the Temporal SDK can crash at interpreter exit


if __name__ == "__main__":
    main()
