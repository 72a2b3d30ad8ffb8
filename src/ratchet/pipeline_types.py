"""Messages of a pipeline run (docs/pipelines.md): the pipeline workflow, its supervised
stages' workflow and their `supervised_chunk` activity, and what the client reads back.

Standard library only (workflow code imports it in the sandbox); small payloads: configs
as JSON mappings, references (URIs, ids) and scalar metrics, never tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ratchet.types import TrainingInput


def stage_run_id(run_id: str, index: int, kind: str) -> str:
    """The id of stage `index` (its child workflow and its run folder): `<run>-stage-<i>-<kind>`."""
    return f"{run_id}-stage-{index}-{kind}"


@dataclass
class StagePlan:
    """One stage as the client planned it: a supervised stage's config, or an rl stage's
    TrainingInput (whose model.path the workflow points at the previous stage's model)."""

    index: int
    kind: str  # sft | dpo | rl
    run_id: str
    supervised: dict[str, Any] | None = None  # the stage's config (SftStage / DpoStage), as JSON
    training: TrainingInput | None = None


@dataclass
class PipelineInput:
    run_id: str
    model_uri: str  # the first stage's starting model (model.path)
    storage_root: str
    seed: int
    torch_threads: int
    cpus: float  # Ray CPUs a supervised stage's task takes (resources.trainer_cpus)
    heartbeat_timeout_s: float
    stages: list[StagePlan]
    search_attributes: bool = False


@dataclass
class SupervisedStageInput:
    run_id: str  # the stage's id (stage_run_id)
    stage_index: int
    stage: dict[str, Any]
    model_uri: str  # where the stage starts
    storage_root: str
    seed: int
    torch_threads: int
    cpus: float
    heartbeat_timeout_s: float
    resume: "StageState | None" = None  # set when the workflow continues as new


@dataclass
class StageState:
    next_step: int = 0
    chunks: int = 0
    run_uri: str = ""
    model_uri: str = ""
    train_first: dict[str, float] = field(default_factory=dict)
    train_last: dict[str, float] = field(default_factory=dict)
    eval_first: dict[str, float] = field(default_factory=dict)
    eval_last: dict[str, float] = field(default_factory=dict)


@dataclass
class ChunkInput:
    run_id: str
    storage_root: str
    stage_index: int
    stage: dict[str, Any]
    model_uri: str
    start: int
    end: int
    seed: int
    torch_threads: int
    cpus: float


@dataclass
class ChunkOutput:
    run_uri: str
    start: int
    end: int
    checkpoint: str
    train: dict[str, float]
    eval_before: dict[str, float]
    eval_after: dict[str, float]
    model_uri: str  # final/model once the stage's last step is trained, else ""
    seconds: float


@dataclass
class StageResult:
    """What a stage did: its run, the model it ended with, and its own metric before and
    after (sft: eval/loss; dpo: eval/reward_accuracy, eval/reward_margin, ...; rl:
    reward_mean of the first and last ten steps and eval_reward)."""

    index: int
    kind: str
    run_id: str
    run_uri: str
    model_uri: str
    steps: int
    metrics_first: dict[str, float] = field(default_factory=dict)
    metrics_last: dict[str, float] = field(default_factory=dict)


@dataclass
class PipelineProgress:
    run_id: str
    stage: int  # index of the stage running (len(stages) once done)
    total_stages: int
    kind: str
    stage_run_id: str
    completed: list[StageResult] = field(default_factory=list)


@dataclass
class PipelineSummary:
    run_id: str
    stages: list[StageResult]
    final_model_uri: str
