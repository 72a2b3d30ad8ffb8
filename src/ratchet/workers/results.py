"""What the actors return: typed, frozen results instead of dicts.

Ray pickles them between processes (they are not stored anywhere durable); the
activities turn them into the dataclasses that cross Temporal (src/ratchet/types.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GenerateResult:
    """`RolloutWorker.generate`: one stored rollout part."""

    uri: str
    num_samples: int
    num_response_tokens: int
    response_length_mean: float
    generate_seconds: float
    policy_version: int  # the version it started with: the oldest of its tokens


@dataclass(frozen=True)
class RolloutShare:
    """`RolloutWorker.generate_share`: one replica's share of a batch, in memory (Ray's
    object store), for `RolloutWorker.save_shares` to store as one batch
    (workers/actors/rollout_pool.py)."""

    batch: Any  # RolloutBatch (typed loosely: this module imports no torch)
    baseline: Any  # RolloutBatch of the greedy baseline (ReMax), or None
    generate_seconds: float
    policy_version: int  # the version it started with


@dataclass(frozen=True)
class LoadReport:
    """`RolloutWorker.load_published`: the version a replica serves after the load, the
    bytes it received and how long the load took."""

    version: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class EvalBatchResult:
    """`RolloutWorker.generate_eval`: the stored greedy eval batch."""

    uri: str
    num_samples: int
    policy_version: int


@dataclass(frozen=True)
class ScoreResult:
    """`RewardWorker.score`: the rewards of one stored part, summarised."""

    reward_mean: float
    reward_std: float
    num_samples: int
    # Groups whose rewards differ: the ones that teach GRPO-style estimators something.
    informative_groups: int
    seconds: float


@dataclass(frozen=True)
class TrainResult:
    """`TrainerWorker.train`: the policy version after the update and its metrics."""

    policy_version: int
    metrics: dict[str, float]
    kl_coef: float  # for the next update (an adaptive controller moves it)
    safe_lambda: float | None = None  # Safe-RLHF: the Lagrange multiplier for the next update


@dataclass(frozen=True)
class WarmupResult:
    """`warmup_policy`: the warmed-up policy in the run folder and the warm-up's losses."""

    uri: str
    loss_first: float
    loss_last: float
    seconds: float  # 0 when a retried warm-up found the model already committed


@dataclass(frozen=True)
class SetupInfo:
    """`TrainerWorker.setup_info`: whether a rank is set up, in which world."""

    ready: bool
    world_size: int
    num_parameters: int
    process_group_inits: int  # init_process_group calls in the actor: 1, unless a retry broke it
    policy_uri: str = ""  # the policy it sets up with (rank 0 made for the warm-up: the warm-up model)


@dataclass(frozen=True)
class CheckpointStarted:
    """`TrainerWorker.start_checkpoint`: the snapshot taken; the write runs on (unless
    in the foreground, whose error is then here)."""

    name: str
    stall_seconds: float
    waited_seconds: float  # for the previous checkpoint's write to finish
    policy_version: int
    error: str | None = None


@dataclass(frozen=True)
class CheckpointOutcome:
    """`TrainerWorker.wait_checkpoint` / `redo_checkpoint`: the latest checkpoint's
    error (None: committed, or none taken), and whether a redo was impossible (the
    trainer trained on)."""

    error: str | None
    seconds: float = 0.0
    impossible: bool = False
