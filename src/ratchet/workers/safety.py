"""Safe-RLHF in the workers: the cost of each sample (reward worker) and the advantage
mixed from reward and cost by the Lagrange multiplier (trainer).

The maths is in algorithms/safe_rlhf.py; this is the glue. Costs are scored next to the
rewards, with the reward function's contract (`safety.cost_function`) and/or a
one-label sequence-classification model (`safety.cost_model_path`), summed, and stored
in the batch's scores part, so a replayed update (recovery) trains on the same costs.
The multiplier is carried durably by the workflow (`RunState.safe_lambda`, as
`kl_coef`): each update gets the one in force, steps it on the batch's mean cost and
returns the new one, which this update's advantages already use (safe-rlhf's order:
the multiplier is stepped at the start of each RL step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from ratchet.algorithms.advantages import AdvInputs, AdvOutput, AdvParams, sequence_rewards_to_tokens
from ratchet.algorithms.safe_rlhf import combined_advantages, lagrange_update
from ratchet.errors import NonFiniteError
from ratchet.tasks.loading import load_reward_fn

from .batch import RolloutBatch
from .scoring import RewardModelScorer, score_batch


class CostScorer:
    """`safety.cost_function` + `safety.cost_model_path` (each optional), summed."""

    def __init__(self, safety):
        self.fn = load_reward_fn(safety.cost_function) if safety.cost_function else None
        self.model = None
        if safety.cost_model_path:
            try:
                self.model = RewardModelScorer(safety.cost_model_path)
            except ValueError as e:
                message = str(e).replace("reward.model_path", "safety.cost_model_path").replace("a reward model", "a cost model")
                raise ValueError(message) from None

    def score(self, batch: RolloutBatch, tokenizer, batch_index: int | None = None) -> torch.Tensor:
        """[B] costs; NonFiniteError naming the sample when one is NaN or infinite."""
        total = torch.zeros(len(batch))
        if self.fn is not None:
            total += score_batch(batch, tokenizer, self.fn, batch_index, field="safety.cost_function")[0]
        if self.model is not None:
            total += self.model.score(batch, tokenizer)
        check_finite_costs(total, batch.samples, batch_index)
        return total


def check_finite_costs(costs: torch.Tensor, samples: list[dict], batch_index: int | None) -> None:
    bad = torch.nonzero(~torch.isfinite(costs)).flatten().tolist()
    if bad:
        row = bad[0]
        at = f"batch {batch_index}, " if batch_index is not None else ""
        raise NonFiniteError(
            f"the cost gave {float(costs[row])} at {at}row {row} (data_source {samples[row].get('data_source')!r}) "
            f"({len(bad)} non-finite costs in the batch); costs must be finite numbers: fix safety.cost_function or "
            "safety.cost_model_path"
        )


@dataclass
class SafeRLHFEstimator:
    """The configured estimator applied to the reward and to the cost, mixed as
    (A_r - lambda A_c) / (1 + lambda) with lambda stepped first on this batch's mean cost.
    Called like an estimator; `lam` and `metrics` are read after the call."""

    estimator: Callable[[AdvInputs, AdvParams], AdvOutput]
    costs: torch.Tensor | None  # [B], every sample of the step
    lam: float  # the multiplier in force; after the call, the stepped one
    safety: Any  # SafetyConfig, or the GPU check's snapshot of one (read by attribute)
    metrics: dict[str, float] = field(default_factory=dict)

    def __call__(self, inputs: AdvInputs, params: AdvParams) -> AdvOutput:
        s = self.safety
        if self.costs is None:
            raise ValueError(
                "safety is configured but the batch has no costs: it was scored without safety.cost_function or "
                "safety.cost_model_path; score it again, or resume from a checkpoint with the same safety section"
            )
        costs = self.costs.float()
        check_finite_costs(costs, [{}] * len(costs), None)
        mean_cost = float(costs.mean().item()) if len(costs) else 0.0
        self.lam = lagrange_update(self.lam, mean_cost, s.budget, s.lambda_lr, mode=s.lambda_update, lam_max=s.lambda_max)
        reward = self.estimator(inputs, params)
        cost_tokens = sequence_rewards_to_tokens(costs, inputs.response_mask)
        cost = self.estimator(replace(inputs, token_rewards=cost_tokens), params)
        mask = inputs.response_mask
        tokens = mask.sum().clamp(min=1)
        self.metrics = {
            "safe/lambda": self.lam,
            "safe/cost_mean": mean_cost,
            "safe/cost_budget": float(s.budget),
            "safe/cost_budget_violation": max(0.0, mean_cost - s.budget),
            "safe/cost_adv_abs_mean": (cost.advantages.abs() * mask).sum().item() / tokens.item(),
        }
        if not math.isfinite(self.lam):
            raise NonFiniteError(f"the Lagrange multiplier became {self.lam}; set safety.lambda_max or lower safety.lambda_lr")
        return AdvOutput(advantages=combined_advantages(reward.advantages, cost.advantages, self.lam), returns=reward.returns)


def safety_on(safety) -> bool:
    """Whether a `safety` section asks for Safe-RLHF (a cost function or model is set). Read
    from the fields, not `SafetyConfig.enabled`: the GPU check's config snapshot holds
    fields only."""
    return safety is not None and (safety.cost_function is not None or safety.cost_model_path is not None)


def safe_rlhf_estimator(cfg, estimator: Callable, costs: torch.Tensor | None, lam: float | None) -> SafeRLHFEstimator | None:
    """The Safe-RLHF wrapper of `estimator` when the config has a cost (None: the multiplier
    in force is `safety.lambda_init`), else None."""
    safety = cfg.safety
    if not safety_on(safety):
        return None
    return SafeRLHFEstimator(estimator, costs, safety.lambda_init if lam is None else lam, safety)
