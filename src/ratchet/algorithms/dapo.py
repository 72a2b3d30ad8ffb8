"""DAPO's batch-shaping extras (Yu et al., 2025, "DAPO: An Open-Source LLM Reinforcement
Learning System at Scale", arXiv:2503.14476): dynamic sampling and soft overlong punishment.
Clip-higher is `LossParams.clip_ratio_high`; token-level loss is `loss_agg_mode=token-mean`.
"""

from __future__ import annotations

import torch


def dynamic_sampling_keep(scores: torch.Tensor, group: torch.Tensor, atol: float = 0.0) -> torch.Tensor:
    """DAPO dynamic sampling: bool [B], False for every sample of a group whose scores all
    agree (max - min <= atol), True otherwise.

    Such a group has zero group-relative advantage (GRPO/RLOO) and only dilutes the batch.
    A group of one always agrees with itself, so it is dropped too. The caller over-samples
    and refills the batch with kept groups (`algorithm.dynamic_sampling`).
    """
    scores = scores.detach().to(torch.float64).flatten()
    _, inverse = torch.unique(group.flatten(), return_inverse=True)
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    high = torch.full((n_groups,), -torch.inf, dtype=torch.float64, device=scores.device)
    low = torch.full((n_groups,), torch.inf, dtype=torch.float64, device=scores.device)
    high = high.scatter_reduce(0, inverse, scores, reduce="amax")
    low = low.scatter_reduce(0, inverse, scores, reduce="amin")
    return (high - low)[inverse] > atol


def overlong_penalty(
    response_lengths: torch.Tensor, max_response_length: int, overlong_buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """DAPO soft overlong punishment, a reward term [B] added to each sequence's score:

        L_max = max_response_length, L_cache = overlong_buffer_len, L = response length
        R(L) = 0                                    if L <= L_max - L_cache
             = -penalty_factor * (L - (L_max - L_cache)) / L_cache   if L_max - L_cache < L <= L_max
             = -penalty_factor                      if L > L_max

    (the paper's penalty_factor is 1). A zero buffer is a hard step: 0 up to L_max,
    -penalty_factor beyond. Config: `algorithm.overlong.{buffer_len,penalty_factor}`.
    """
    length = response_lengths.detach().to(torch.float32)
    if overlong_buffer_len <= 0:
        return torch.where(length > max_response_length, -float(penalty_factor), 0.0)
    start = float(max_response_length - overlong_buffer_len)
    exceed = (length - start).clamp(min=0.0, max=float(overlong_buffer_len))
    return exceed * (-float(penalty_factor) / float(overlong_buffer_len)) + 0.0  # + 0.0: no -0.0
