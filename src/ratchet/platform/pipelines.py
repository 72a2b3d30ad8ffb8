"""Submitting a pipeline (a run config with `stages:`, docs/pipelines.md) and its handle.

Everything a stage needs is checked here, before the pipeline starts: the config (each rl
stage's merged config is a valid run: config/pipeline_plan.py) and, on this machine, each
supervised stage's datasets (every row read and tokenized with the starting model's
tokenizer), so a bad row in stage 3's data fails the submit, not the run an hour in.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from ratchet.ids import check_id
from ratchet.pipeline_types import PipelineInput, PipelineProgress, PipelineSummary, StagePlan, stage_run_id
from ratchet.types import TrainingInput

from .handles import ClientConnection, WorkflowHandle

if TYPE_CHECKING:
    from ratchet.config.schema import RunConfig

WORKFLOW = "PipelineWorkflow"


@dataclass
class PipelineHandle(WorkflowHandle):
    client: ClientConnection
    run_id: str

    summary_type: ClassVar[type] = PipelineSummary
    progress_type: ClassVar[type] = PipelineProgress

    @property
    def workflow_id(self) -> str:
        return self.run_id


def stage_data_issues(cfg: RunConfig) -> list[tuple[str, str]]:
    """(field, message) for each supervised stage whose data cannot be read or tokenized with
    the starting model's tokenizer (the first stage's model.path: stages hand the tokenizer on)."""
    from ratchet.data.conversations import SupervisedDataError, encode_conversation, encode_pair, read_conversations, read_preferences
    from ratchet.data.files import DatasetFileError

    issues: list[tuple[str, str]] = []
    tokenizer = None
    for i, stage in enumerate(cfg.stages):
        if stage.kind == "rl":
            continue
        for key in ("train_files", "eval_files"):
            path = getattr(stage.data, key)
            field = f"stages.{i}.data.{key}"
            if path is None:
                continue
            if not Path(path).exists():
                issues.append((field, f"file not found: {path}"))
                continue
            try:
                if tokenizer is None:
                    from ratchet.hf_imports import load_tokenizer

                    tokenizer = load_tokenizer(cfg.model.path)
                d = stage.data
                if stage.kind == "sft":
                    lengths = [len(encode_conversation(tokenizer, m).input_ids) for m in read_conversations(path, d.messages_key)]
                else:
                    pairs = read_preferences(path, d.prompt_key, d.chosen_key, d.rejected_key)
                    lengths = [max(len(e.input_ids) for e in encode_pair(tokenizer, p)) for p in pairs]
            except (SupervisedDataError, DatasetFileError) as exc:
                issues.append((field, str(exc)))
                continue
            over = [r for r, n in enumerate(lengths) if n > stage.max_length]
            if over:
                issues.append((field, f"row {over[0]} is {lengths[over[0]]} tokens, over stages.{i}.max_length={stage.max_length}"))
    return issues


def _absolute_stage_paths(cfg: RunConfig) -> RunConfig:
    """Stage data paths made absolute (workers run in other folders), as the loader does
    for data.train_files."""
    stages = []
    for stage in cfg.stages:
        if stage.kind != "rl":
            data = stage.data.model_copy(
                update={k: str(Path(v).expanduser().resolve()) for k in ("train_files", "eval_files") if (v := getattr(stage.data, k))}
            )
            stage = stage.model_copy(update={"data": data})
        stages.append(stage)
    return cfg.model_copy(update={"stages": stages})


def start_pipeline(client: ClientConnection, cfg: RunConfig, run_id: str, *, check_files: bool = True) -> PipelineHandle:
    """Check the stages, plan them and start the pipeline workflow `run_id`."""
    from ratchet.config import ConfigError
    from ratchet.config.loop_plan import loop_plan
    from ratchet.config.pipeline_plan import rl_stage_config

    cfg = _absolute_stage_paths(cfg)
    if check_files:
        issues = stage_data_issues(cfg)
        if issues:
            raise ConfigError(issues)
    plans = []
    for i, stage in enumerate(cfg.stages):
        sid = check_id(stage_run_id(run_id, i, stage.kind), f"stage {i}'s run id (from the run id)")
        if stage.kind == "rl":
            rl = rl_stage_config(cfg, i)
            training = TrainingInput(run_id=sid, config=rl.model_dump(mode="json"), plan=loop_plan(rl))
            training.search_attributes = client.has_search_attributes()
            plans.append(StagePlan(index=i, kind="rl", run_id=sid, training=training))
        else:
            plans.append(StagePlan(index=i, kind=stage.kind, run_id=sid, supervised=stage.model_dump(mode="json")))
    inp = PipelineInput(
        run_id=run_id, model_uri=cfg.model.path, storage_root=cfg.storage.root, seed=cfg.seed,
        torch_threads=cfg.resources.torch_threads, cpus=cfg.resources.trainer_cpus,
        heartbeat_timeout_s=cfg.loop.heartbeat_timeout_s, stages=plans,
    )  # fmt: skip
    kinds = " -> ".join(s.kind for s in cfg.stages)
    client._run(
        client._temporal.start_workflow(
            WORKFLOW,
            inp,
            id=run_id,
            task_queue=client.task_queue,
            static_summary=f"pipeline {run_id}: {kinds}",
            memo={"tags": cfg.tracking.tags, "model": cfg.model.path, "stages": kinds},
        )  # fmt: skip
    )
    return PipelineHandle(client, run_id)


def follow_pipeline(handle: PipelineHandle, console, every: float = 1.0) -> PipelineSummary:
    """`ratchet train` on a pipeline: a line as each stage starts and one with its own metric
    as it ends, then a table of the stages. KeyboardInterrupt passes through (the pipeline
    goes on)."""
    seen_started, seen_done = -1, 0
    for p in handle.follow(every):
        for r in p.completed[seen_done:]:
            console.print(f"stage {r.index} ({r.kind}) done: {_metric_text(r)}", soft_wrap=True, highlight=False)
        seen_done = len(p.completed)
        if p.stage < p.total_stages and p.stage != seen_started:
            console.print(f"stage {p.stage}/{p.total_stages - 1} ({p.kind}): run {p.stage_run_id}", soft_wrap=True, highlight=False)
            seen_started = p.stage
    summary = handle.result()
    from rich.table import Table

    table = Table(title=f"pipeline {summary.run_id}")
    for col in ("stage", "kind", "run", "steps", "metric (first -> last)", "model"):
        table.add_column(col, overflow="fold")
    for r in summary.stages:
        table.add_row(str(r.index), r.kind, r.run_id, str(r.steps), _metric_text(r), r.model_uri)
    console.print(table)
    return summary


# The metric each kind of stage is judged by, first in the line.
_HEADLINE = {
    "sft": ("eval/loss", "train/loss"),
    "dpo": ("eval/reward_accuracy", "eval/reward_margin", "train/loss"),
    "rl": ("reward_mean", "eval_reward"),
}


def _metric_text(r) -> str:
    keys = [k for k in _HEADLINE.get(r.kind, ()) if k in r.metrics_last]
    return ", ".join(f"{k} {r.metrics_first.get(k, float('nan')):.3f} -> {r.metrics_last[k]:.3f}" for k in keys) or "-"
