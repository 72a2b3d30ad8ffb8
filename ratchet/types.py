"""Messages that cross layers: workflow <-> activities, and what the client reads back.

This module imports only the standard library so that workflow code can import it inside
the Temporal sandbox. Every field is small: payloads carry references (URIs, ids) and
scalar metrics, never tensors or samples (DESIGN.md, rule 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TASK_QUEUE = "ratchet"


@dataclass
class RunRef:
    """Where a run lives. Activities read the run's config from `run_uri/config.json`."""

    run_id: str
    run_uri: str
    # A digest of the stored config: a resumed run with another config (say, another
    # trainer world size) is a different cache key for the activities.
    config_id: str = ""


@dataclass
class LoopPlan:
    """The parts of the config the workflow needs to schedule work, derived by the client."""

    steps: int
    prompts_per_step: int
    eval_every: int
    evaluate: bool = True  # False when the config has no eval data
    kl_coef: float = 0.0  # initial KL coefficient; the workflow carries the adapted one
    sampling_rounds: int = 1  # > 1 with DAPO dynamic sampling: rollout rounds allowed per step
    mode: str = "sync"  # sync | one_step_off | fully_async
    max_staleness: int = 1  # fully_async: most policy versions a trained sample may lag
    queue_limit: int = 2  # fully_async: most batches generated ahead of the trainer
    sync_every: int = 1  # fully_async: weight sync every this many updates
    partial_rollout: bool = False  # fully_async: syncs land inside generations in flight
    checkpoint_every: int = 0  # steps between checkpoints (0: none)
    continue_as_new_every: int = 0  # steps between continue-as-new (0: when Temporal suggests)
    heartbeat_timeout_s: float = 30.0


@dataclass
class ScoredBatch:
    """One rollout round of a batch and its scores: what the trainer consumes."""

    batch: BatchRef
    score: ScoreOutput


@dataclass
class RunState:
    """The run state the workflow owns; carried across continue-as-new."""

    run: RunRef
    next_step: int = 0
    next_prompt: int = 0  # the prompt frontier: prompts before it have been rolled out
    next_batch: int = 0  # index (storage key) of the next rollout batch
    policy_version: int = 0
    rollout_version: int = 0  # policy version the rollout engine serves
    kl_coef: float = 0.0
    # Rolled out and scored, not yet trained on (async modes), oldest first; each entry is
    # the rounds of one batch.
    ready: list[list[ScoredBatch]] = field(default_factory=list)
    # Prompt ranges whose batch was too stale to train on: rolled out again before new ones.
    retry_prompts: list[int] = field(default_factory=list)
    dropped_samples: int = 0
    rewards: list[float] = field(default_factory=list)
    eval_rewards: dict[str, float] = field(default_factory=dict)
    warmup_loss_first: float = 0.0
    warmup_loss_last: float = 0.0


@dataclass
class TrainingInput:
    run_id: str
    config: dict[str, Any]
    plan: LoopPlan
    # Set when the workflow continues as new, or a run resumes from a checkpoint: the
    # state to carry on from.
    resume: RunState | None = None
    # A resume from a checkpoint: store `config` again and rebuild the workers from it.
    restore: bool = False


@dataclass
class PrepareInput:
    run_id: str
    config: dict[str, Any]


@dataclass
class PrepareOutput:
    run: RunRef


@dataclass
class WarmupInput:
    run: RunRef


@dataclass
class WarmupOutput:
    policy_uri: str
    loss_first: float
    loss_last: float
    seconds: float


@dataclass
class StartWorkersInput:
    run: RunRef
    policy_uri: str  # "" on a resume: the run's initial policy
    restore_version: int | None = None  # a resume: rebuild the trainer at this version


@dataclass
class StartWorkersOutput:
    policy_version: int
    num_parameters: int
    seconds: float


@dataclass
class RolloutInput:
    run: RunRef
    step: int
    prompt_start: int
    prompt_count: int
    policy_version: int
    part: int = 0  # rollout round within the step (dynamic sampling refills)


@dataclass
class BatchRef:
    """A rollout batch in the batch store; its key is derived from (run id, step)."""

    run_id: str
    step: int
    uri: str
    num_prompts: int
    num_samples: int
    num_response_tokens: int
    policy_version: int
    part: int = 0
    prompt_start: int = 0
    generate_seconds: float = 0.0
    response_length_mean: float = 0.0


@dataclass
class ScoreInput:
    run: RunRef
    batch: BatchRef


@dataclass
class ScoreOutput:
    reward_mean: float
    reward_std: float
    seconds: float
    informative_groups: int = 0  # groups whose rewards are not all equal


@dataclass
class TrainInput:
    run: RunRef
    batch: BatchRef
    policy_version: int
    kl_coef: float = 0.0
    parts: int = 1  # rollout rounds of the step to train on


@dataclass
class TrainOutput:
    policy_version: int
    metrics: dict[str, float]
    seconds: float
    kl_coef: float = 0.0  # the controller's coefficient for the next step


@dataclass
class SyncInput:
    run: RunRef
    policy_version: int


@dataclass
class SyncOutput:
    policy_version: int
    seconds: float
    megabytes: float


@dataclass
class EvalInput:
    run: RunRef
    step: int
    policy_version: int


@dataclass
class EvalOutput:
    step: int
    reward_mean: float
    num_samples: int


@dataclass
class StepRecord:
    """One line of `metrics.jsonl`; written once per step, keyed by step."""

    run: RunRef
    step: int
    metrics: dict[str, float]


@dataclass
class CheckpointInput:
    run: RunRef
    step: int  # steps done; the checkpoint is named after it
    policy_version: int
    state: RunState  # what a resume from this checkpoint carries on from


@dataclass
class CheckpointOutput:
    name: str
    stall_seconds: float  # how long training was held up (the upload is not waited for)
    waited_seconds: float  # waiting for the previous checkpoint's upload first


@dataclass
class FinishInput:
    run: RunRef
    policy_version: int


@dataclass
class FinishOutput:
    final_policy_uri: str


@dataclass
class Progress:
    """What the `progress` query returns."""

    run_id: str
    phase: str
    step: int
    total_steps: int
    policy_version: int
    reward_mean: float | None = None
    tokens_per_second: float | None = None
    eval_rewards: dict[str, float] = field(default_factory=dict)
    paused: bool = False
    stopping: bool = False


@dataclass
class BatchStatus:
    """One batch the `batches` query lists."""

    index: int
    state: str  # in_flight | ready
    policy_version: int  # the version that generated it (or is generating it)
    num_samples: int = 0


@dataclass
class RunSummary:
    """The workflow's result."""

    run_id: str
    run_uri: str
    steps: int
    policy_version: int
    final_policy_uri: str
    reward_first10: float
    reward_last10: float
    eval_rewards: dict[str, float]
    warmup_loss_first: float
    warmup_loss_last: float
    stopped: bool = False  # ended early by the `stop` signal
    dropped_samples: int = 0  # fully_async: samples too stale to train on (their prompts were redone)
