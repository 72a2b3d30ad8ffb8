"""Policy-gradient losses. Each returns the per-token loss matrix and per-token clip
indicators; aggregation to a scalar is a separate, registered choice (aggregation.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .registry import Registry, decorator


@dataclass(frozen=True)
class LossParams:
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2


@dataclass
class TokenLoss:
    loss: torch.Tensor  # [B, T], before masking
    clipped: torch.Tensor  # [B, T] bool: the clip bound was active for this token
    ratio: torch.Tensor  # [B, T] importance ratio pi / pi_old


PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LossParams], TokenLoss]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", "algorithm.policy_loss")


def register_policy_loss(name: str):
    return decorator(POLICY_LOSSES, name)


@register_policy_loss("ppo_clip")
def ppo_clip(
    logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, params: LossParams
) -> TokenLoss:
    """PPO's clipped surrogate (Schulman et al., 2017) with separate low and high bounds
    (DAPO's clip-higher, Yu et al., 2025): loss = -min(r A, clip(r, 1-eps_low, 1+eps_high) A).
    The log-ratio is clamped to +-20 so extreme values give large but finite losses."""
    log_ratio = (logprob - old_logprob).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    return TokenLoss(loss=loss, clipped=(clipped > unclipped) & mask.bool(), ratio=ratio)
