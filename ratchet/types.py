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


@dataclass
class LoopPlan:
    """The parts of the config the workflow needs to schedule work, derived by the client."""

    steps: int
    prompts_per_step: int
    eval_every: int
    evaluate: bool = True  # False when the config has no eval data
    kl_coef: float = 0.0  # initial KL coefficient; the workflow carries the adapted one
    sampling_rounds: int = 1  # > 1 with DAPO dynamic sampling: rollout rounds allowed per step


@dataclass
class RunState:
    """The run state the workflow owns; carried across continue-as-new."""

    run: RunRef
    policy_uri: str
    next_step: int = 0
    next_prompt: int = 0  # the prompt frontier: prompts before it have been rolled out
    policy_version: int = 0
    kl_coef: float = 0.0
    rewards: list[float] = field(default_factory=list)
    eval_rewards: dict[str, float] = field(default_factory=dict)
    warmup_loss_first: float = 0.0
    warmup_loss_last: float = 0.0


@dataclass
class TrainingInput:
    run_id: str
    config: dict[str, Any]
    plan: LoopPlan
    # Set when the workflow continues as new: the state to carry on from.
    resume: RunState | None = None


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
    policy_uri: str


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
