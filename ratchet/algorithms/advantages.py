"""Advantage estimators. All share one signature so the trainer can call any of them:

    fn(inputs: AdvInputs, params: AdvParams) -> AdvOutput   # advantages and returns, [B, T]

`token_rewards` holds each sequence's reward on its last response token (plus any
per-token KL penalty when the KL is in the reward); outcome estimators use its sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .registry import Registry


@dataclass(frozen=True)
class AdvParams:
    norm_adv_by_std: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    epsilon: float = 1e-6


@dataclass
class AdvInputs:
    token_rewards: torch.Tensor  # [B, T]
    response_mask: torch.Tensor  # [B, T] float
    group: torch.Tensor  # [B] int64: samples of the same prompt share a group
    values: torch.Tensor | None = None  # [B, T] critic values (GAE)
    baseline_rewards: torch.Tensor | None = None  # [B] reward of a baseline response (ReMax)

    @property
    def scores(self) -> torch.Tensor:
        """One scalar per sequence."""
        return (self.token_rewards * self.response_mask).sum(-1)


@dataclass
class AdvOutput:
    advantages: torch.Tensor  # [B, T], zero outside the response mask
    returns: torch.Tensor  # [B, T], the value target where a critic is trained


@dataclass(frozen=True)
class AdvEstimator:
    fn: Callable[[AdvInputs, AdvParams], AdvOutput]
    needs_group: bool = False
    needs_critic: bool = False
    needs_baseline: bool = False


ADV_ESTIMATORS: Registry[AdvEstimator] = Registry("advantage estimator", "algorithm.adv_estimator")


def register_adv_estimator(name: str, *, needs_group: bool = False, needs_critic: bool = False, needs_baseline: bool = False):
    def apply(fn):
        ADV_ESTIMATORS.register(name, AdvEstimator(fn, needs_group, needs_critic, needs_baseline))
        return fn

    return apply


def group_stats(values: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group size, group mean and unbiased group std (0 for a group of one)."""
    _, inverse, counts = torch.unique(group, return_inverse=True, return_counts=True)
    counts_f = counts.to(values.dtype)
    mean = torch.zeros_like(counts_f).index_add_(0, inverse, values) / counts_f
    sq = torch.zeros_like(counts_f).index_add_(0, inverse, (values - mean[inverse]).square())
    std = torch.where(counts > 1, (sq / (counts_f - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))
    return counts[inverse], mean[inverse], std[inverse]


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> AdvOutput:
    adv = per_seq.unsqueeze(-1) * mask
    return AdvOutput(advantages=adv, returns=adv)


@register_adv_estimator("grpo", needs_group=True)
def grpo(inputs: AdvInputs, params: AdvParams) -> AdvOutput:
    """GRPO (Shao et al., 2024): A = (r - mean_group) / (std_group + eps).

    With `norm_adv_by_std=False` this is Dr. GRPO (Liu et al., 2025): A = r - mean_group.
    A group of one, or a group whose rewards are all equal, has advantage 0: it carries no
    signal about which sample was better.
    """
    scores = inputs.scores.float()
    count, mean, std = group_stats(scores, inputs.group)
    adv = scores - mean
    if params.norm_adv_by_std:
        adv = adv / (std + params.epsilon)
    return _broadcast(torch.where(count > 1, adv, torch.zeros_like(adv)), inputs.response_mask)


@register_adv_estimator("rloo", needs_group=True)
def rloo(inputs: AdvInputs, params: AdvParams) -> AdvOutput:
    """RLOO (Ahmadian et al., 2024): baseline is the mean of the *other* samples of the group,
    A_i = r_i - (sum_group - r_i) / (n - 1) = n / (n - 1) * (r_i - mean_group).
    A group of one has advantage 0."""
    scores = inputs.scores.float()
    count, mean, _ = group_stats(scores, inputs.group)
    n = count.to(scores.dtype)
    adv = torch.where(count > 1, n / (n - 1).clamp(min=1) * (scores - mean), torch.zeros_like(mean))
    return _broadcast(adv, inputs.response_mask)


def sequence_rewards_to_tokens(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] rewards placed on each sequence's last response token, [B, T]."""
    token_rewards = torch.zeros_like(response_mask, dtype=torch.float32)
    last = (response_mask.sum(-1).long() - 1).clamp(min=0)
    token_rewards[torch.arange(len(rewards)), last] = rewards.float() * (response_mask.sum(-1) > 0)
    return token_rewards
