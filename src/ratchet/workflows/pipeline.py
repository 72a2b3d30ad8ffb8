"""Pipelines of stages (docs/pipelines.md): `PipelineWorkflow` runs a run config's `stages`
in order as child workflows, each starting from the model the stage before it ended with;
`SupervisedStageWorkflow` is an sft or dpo stage, one `supervised_chunk` activity per
chunk of steps.

Durability is Temporal's and the names': stage i is the child workflow
`<run>-stage-<i>-<kind>` (its run folder too), started once and recorded in the
pipeline's history, so a pipeline whose worker died replays the stages already done from
their results and never runs them again; a stage that was running goes on where its own
history says. A supervised stage's history holds one activity per chunk: chunk [s, e)
starts from the checkpoint that chunk [., s) committed, and a chunk retried after a crash
recomputes the same steps from that same checkpoint (workers/supervised.py). An rl stage
is the ordinary TrainingWorkflow, started with model.path set to the previous stage's
final model (a model folder in the object store, which every worker reads through
hf_io.local_hf_path); its durability is the training workflow's own.

Deterministic (docs/design.md, rule 8): no I/O, no clocks; activities and child workflows
by name, types from `ratchet.pipeline_types`.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from ratchet.pipeline_types import (
        ChunkInput,
        ChunkOutput,
        PipelineInput,
        PipelineProgress,
        PipelineSummary,
        StagePlan,
        StageResult,
        StageState,
        SupervisedStageInput,
    )
    from ratchet.types import RunSummary
    from ratchet.workflows import search_attributes as sa
    from ratchet.workflows.phases import RETRY

# One chunk's time limit (an attempt); it heartbeats while the Ray task runs.
CHUNK_TIMEOUT = timedelta(minutes=60)


@workflow.defn(name="PipelineWorkflow")
class PipelineWorkflow:
    # The input at construction (workflow.init): the progress query finds it from the start.
    @workflow.init
    def __init__(self, inp: PipelineInput) -> None:
        self._inp: PipelineInput = inp
        self._stage = 0
        self._done: list[StageResult] = []

    @workflow.query
    def progress(self) -> PipelineProgress:
        inp = self._inp
        stages = inp.stages
        current = stages[self._stage] if self._stage < len(stages) else None
        return PipelineProgress(
            run_id=inp.run_id,
            stage=self._stage,
            total_stages=len(stages),
            kind=current.kind if current else "done",
            stage_run_id=current.run_id if current else "",
            completed=list(self._done),
        )

    @workflow.run
    async def run(self, inp: PipelineInput) -> PipelineSummary:
        model = inp.model_uri
        for plan in inp.stages:
            self._stage = plan.index
            result = await (self._rl(plan, model) if plan.kind == "rl" else self._supervised(plan, model))
            self._done.append(result)
            model = result.model_uri
        self._stage = len(inp.stages)
        return PipelineSummary(run_id=inp.run_id, stages=list(self._done), final_model_uri=model)

    async def _supervised(self, plan: StagePlan, model: str) -> StageResult:
        inp = self._inp
        child = SupervisedStageInput(
            run_id=plan.run_id, stage_index=plan.index, stage=plan.supervised or {}, model_uri=model,
            storage_root=inp.storage_root, seed=inp.seed, torch_threads=inp.torch_threads, cpus=inp.cpus,
            heartbeat_timeout_s=inp.heartbeat_timeout_s,
        )  # fmt: skip
        return await workflow.execute_child_workflow(
            "SupervisedStageWorkflow",
            child,
            id=plan.run_id,
            result_type=StageResult,
            # A pipeline cancelled or terminated from outside cancels the stage it runs.
            parent_close_policy=workflow.ParentClosePolicy.REQUEST_CANCEL,
            static_summary=f"pipeline {inp.run_id}: stage {plan.index} ({plan.kind})",
        )

    async def _rl(self, plan: StagePlan, model: str) -> StageResult:
        training = plan.training
        assert training is not None, "an rl stage is planned with its TrainingInput"
        config = copy.deepcopy(training.config)
        if plan.index > 0:
            config["model"]["path"] = model  # the previous stage's final model
        training = replace(training, config=config)
        extra = {}
        if training.search_attributes:
            extra["search_attributes"] = sa.initial_attributes(config, training.lineage)
        summary: RunSummary = await workflow.execute_child_workflow(
            "TrainingWorkflow",
            training,
            id=plan.run_id,
            result_type=RunSummary,
            parent_close_policy=workflow.ParentClosePolicy.REQUEST_CANCEL,
            static_summary=sa.static_summary(plan.run_id, config, training.lineage),
            static_details=sa.static_details(plan.run_id, config, training.lineage),
            **extra,
        )
        evals = summary.eval_rewards
        first = {"reward_mean": summary.reward_first10}
        last = {"reward_mean": summary.reward_last10}
        if evals:
            steps = sorted(evals, key=int)
            first["eval_reward"], last["eval_reward"] = evals[steps[0]], evals[steps[-1]]
        return StageResult(
            index=plan.index, kind="rl", run_id=plan.run_id, run_uri=summary.run_uri, model_uri=summary.final_policy_uri,
            steps=summary.steps, metrics_first=first, metrics_last=last,
        )  # fmt: skip


@workflow.defn(name="SupervisedStageWorkflow")
class SupervisedStageWorkflow:
    def __init__(self) -> None:
        self._state: StageState | None = None

    @workflow.query
    def progress(self) -> StageState | None:
        return self._state

    @workflow.run
    async def run(self, inp: SupervisedStageInput) -> StageResult:
        state = self._state = inp.resume or StageState()
        steps, chunk = int(inp.stage["steps"]), int(inp.stage["chunk_steps"])
        while state.next_step < steps:
            end = min(steps, state.next_step + chunk)
            # fmt: off
            chunk_input = ChunkInput(
                run_id=inp.run_id, storage_root=inp.storage_root, stage_index=inp.stage_index, stage=inp.stage,
                model_uri=inp.model_uri, start=state.next_step, end=end, seed=inp.seed, torch_threads=inp.torch_threads,
                cpus=inp.cpus,
            )
            # fmt: on
            out: ChunkOutput = await workflow.execute_activity(
                "supervised_chunk",
                chunk_input,
                result_type=ChunkOutput,
                start_to_close_timeout=CHUNK_TIMEOUT,
                heartbeat_timeout=timedelta(seconds=inp.heartbeat_timeout_s),
                retry_policy=RETRY,
                summary=f"stage {inp.stage_index} ({inp.stage.get('kind')}): steps {state.next_step}-{end - 1}",
            )
            if state.chunks == 0:
                state.train_first, state.eval_first = dict(out.train), dict(out.eval_before)
            state.train_last, state.eval_last = dict(out.train), dict(out.eval_after)
            state.next_step, state.chunks, state.run_uri = out.end, state.chunks + 1, out.run_uri
            state.model_uri = out.model_uri or state.model_uri
            if state.next_step < steps and workflow.info().is_continue_as_new_suggested():
                workflow.continue_as_new(replace(inp, resume=state))

        def tagged(train: dict, evals: dict) -> dict[str, float]:
            return {**{f"train/{k}": v for k, v in train.items()}, **{f"eval/{k}": v for k, v in evals.items()}}

        return StageResult(
            index=inp.stage_index, kind=str(inp.stage.get("kind")), run_id=inp.run_id, run_uri=state.run_uri,
            model_uri=state.model_uri, steps=state.next_step, metrics_first=tagged(state.train_first, state.eval_first),
            metrics_last=tagged(state.train_last, state.eval_last),
        )  # fmt: skip
