"""Outcome advantage estimators: one scalar reward per sequence in, per-token advantages out.

All estimators share one signature so the trainer can call any of them:
`fn(rewards [B], group [B] (prompt id), response_mask [B, T], params) -> advantages [B, T]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .registry import Registry


@dataclass(frozen=True)
class AdvParams:
    norm_adv_by_std: bool = True
    epsilon: float = 1e-6


@dataclass(frozen=True)
class AdvEstimator:
    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AdvParams], torch.Tensor]
    needs_group: bool


ADV_ESTIMATORS: Registry[AdvEstimator] = Registry("advantage estimator", "algorithm.adv_estimator")


def register_adv_estimator(name: str, *, needs_group: bool):
    def apply(fn):
        ADV_ESTIMATORS.register(name, AdvEstimator(fn=fn, needs_group=needs_group))
        return fn

    return apply


def _group_stats(rewards: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group size, group mean and (unbiased) group std."""
    _, inverse, counts = torch.unique(group, return_inverse=True, return_counts=True)
    counts_f = counts.to(rewards.dtype)
    sums = torch.zeros_like(counts_f).index_add_(0, inverse, rewards)
    mean = sums / counts_f
    sq = torch.zeros_like(counts_f).index_add_(0, inverse, (rewards - mean[inverse]).square())
    std = torch.where(counts > 1, (sq / (counts_f - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))
    return counts[inverse], mean[inverse], std[inverse]


@register_adv_estimator("grpo", needs_group=True)
def grpo(rewards: torch.Tensor, group: torch.Tensor, response_mask: torch.Tensor, params: AdvParams) -> torch.Tensor:
    """GRPO (Shao et al., 2024): A = (r - mean_group) / (std_group + eps).

    With `norm_adv_by_std=False` this is Dr. GRPO (Liu et al., 2025): A = r - mean_group.
    A group of one, or a group whose rewards are all equal, has advantage 0: it carries no
    signal about which sample was better.
    """
    count, mean, std = _group_stats(rewards.float(), group)
    adv = rewards.float() - mean
    if params.norm_adv_by_std:
        adv = adv / (std + params.epsilon)
    adv = torch.where(count > 1, adv, torch.zeros_like(adv))
    return adv.unsqueeze(-1) * response_mask


@register_adv_estimator("rloo", needs_group=True)
def rloo(rewards: torch.Tensor, group: torch.Tensor, response_mask: torch.Tensor, params: AdvParams) -> torch.Tensor:
    """RLOO (Ahmadian et al., 2024): baseline is the mean of the *other* samples of the group,
    A_i = r_i - (sum_group - r_i) / (n - 1) = n / (n - 1) * (r_i - mean_group).
    A group of one has advantage 0."""
    count, mean, _ = _group_stats(rewards.float(), group)
    n = count.to(rewards.dtype if rewards.is_floating_point() else torch.float32)
    adv = torch.where(count > 1, n / (n - 1).clamp(min=1) * (rewards.float() - mean), torch.zeros_like(mean))
    return adv.unsqueeze(-1) * response_mask
