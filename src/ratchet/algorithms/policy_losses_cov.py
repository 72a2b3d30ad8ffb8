"""Clip-Cov and KL-Cov: PPO-style losses that single out the few tokens whose log-probability
and advantage covary most, the tokens that drive the policy's entropy down (Cui et al., 2025,
"The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
arXiv:2505.22617), and cut (Clip-Cov) or penalise (KL-Cov) their update.

Follows verl's `compute_policy_loss_clip_cov` / `compute_policy_loss_kl_cov`
(verl/trainer/ppo/core_algos.py), with the signature of policy_losses.py. As in verl, the
covariance is taken over the tokens the call sees, one micro-batch
(`trainer.micro_batch_size` sequences) at a time, and the number of tokens selected is a
fraction of that micro-batch's tokens (at least one). Registered by their lines in catalog/algorithms.py.
"""

from __future__ import annotations

import torch

from .policy_losses import LossParams, TokenLoss, _log_ratio


def token_covariance(logprob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token centred product (A_t - mean A)(log pi_t - mean log pi), means over the masked
    tokens; 0 outside the mask. Detached: it only selects tokens."""
    keep = mask.bool()
    n = keep.sum().clamp(min=1)
    with torch.no_grad():
        lp = torch.where(keep, logprob, torch.zeros_like(logprob))
        adv = torch.where(keep, advantages, torch.zeros_like(advantages))
        cov = (adv - adv.sum() / n) * (lp - lp.sum() / n)
        return torch.where(keep, cov, torch.zeros_like(cov))


def clip_cov_select(
    cov: torch.Tensor, candidates: torch.Tensor, mask: torch.Tensor, params: LossParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Clip-Cov's selection (bool [B, T]): among `candidates` whose covariance lies strictly in
    (clip_cov_lb, clip_cov_ub), a uniformly random max(1, int(clip_cov_ratio * N)) of them, N
    the masked tokens (PPO-clipped ones included, as verl counts). verl draws the subset with
    torch.randperm from the global generator; so does this by default (the trainer seeds it at
    start), or from `generator`."""
    inside = candidates & (cov > params.clip_cov_lb) & (cov < params.clip_cov_ub)
    idx = torch.nonzero(inside.flatten()).flatten()
    selected = torch.zeros_like(inside)
    if idx.numel() == 0:
        return selected
    budget = max(int(params.clip_cov_ratio * mask.bool().sum().item()), 1)
    if idx.numel() > budget:
        idx = idx[torch.randperm(idx.numel(), generator=generator)[:budget].to(idx.device)]
    selected.view(-1)[idx] = True
    return selected


def clip_cov(
    logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, params: LossParams
) -> TokenLoss:
    """Clip-Cov (Cui et al., 2025, arXiv:2505.22617; verl `compute_policy_loss_clip_cov`): PPO's
    clipped loss, with the gradient of a few high-covariance tokens cut:

        L_t = max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A) * (1 - s_t)

    s_t = 1 for a random max(1, int(clip_cov_ratio * N)) of the tokens (N: masked tokens of the
    micro-batch) that PPO did not already clip and whose covariance
    (A_t - mean A)(log pi_t - mean log pi) lies in (clip_cov_lb, clip_cov_ub) (verl: 2e-4, 1, 5).
    `clipped` flags every token whose gradient the loss cuts: PPO-clipped or selected. Any
    aggregation; verl's default is `token-mean`. Unlike verl the log-ratio is clamped to +-20
    (finite losses on extreme ratios), as in every ratchet loss.
    """
    if not 0 < params.clip_cov_ratio <= 1:
        raise ValueError(f"clip_cov needs clip_cov_ratio in (0, 1], got {params.clip_cov_ratio}")
    if not params.clip_cov_lb < params.clip_cov_ub:
        raise ValueError(f"clip_cov needs clip_cov_lb ({params.clip_cov_lb}) below clip_cov_ub ({params.clip_cov_ub})")
    keep = mask.bool()
    ratio = _log_ratio(logprob, old_logprob, mask).exp()
    adv = torch.where(keep, advantages, torch.zeros_like(advantages))
    unclipped = -adv * ratio
    clipped_loss = -adv * ratio.clamp(1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    ppo_clipped = (clipped_loss > unclipped) & keep
    cov = token_covariance(logprob, adv, mask)
    selected = clip_cov_select(cov, keep & ~ppo_clipped, mask, params)
    loss = torch.maximum(unclipped, clipped_loss) * (~selected).to(logprob.dtype)
    return TokenLoss(loss=loss, clipped=ppo_clipped | selected, ratio=ratio)


def kl_cov_select(cov: torch.Tensor, mask: torch.Tensor, params: LossParams) -> torch.Tensor:
    """KL-Cov's selection: the max(1, int(kl_cov_ratio * N)) masked tokens of largest covariance
    (N: masked tokens); none when the mask is empty."""
    keep = mask.bool()
    n = int(keep.sum().item())
    selected = torch.zeros_like(keep)
    if n == 0:
        return selected
    k = max(1, int(n * params.kl_cov_ratio))
    idx = torch.nonzero(keep.flatten()).flatten()
    top = torch.topk(cov.flatten()[idx], k, largest=True).indices
    selected.view(-1)[idx[top]] = True
    return selected


def kl_cov(logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, params: LossParams) -> TokenLoss:
    """KL-Cov (Cui et al., 2025, arXiv:2505.22617; verl `compute_policy_loss_kl_cov`): the
    unclipped surrogate, plus a KL-like penalty on the tokens of largest covariance:

        L_t = -r_t A_t + kappa |log r_t| * s_t

    s_t = 1 for the top max(1, int(kl_cov_ratio * N)) masked tokens by
    (A_t - mean A)(log pi_t - mean log pi) (N: masked tokens of the micro-batch); kappa is
    `kl_cov_coef` (verl's `policy_loss.ppo_kl_coef`, 0.1), the ratio `kl_cov_ratio` (2e-4).
    There is no clip at all: the penalty is the only brake. `clipped` flags the penalised
    tokens. Any aggregation; verl's default is `token-mean`. The log-ratio is clamped to +-20.
    """
    if not 0 < params.kl_cov_ratio <= 1:
        raise ValueError(f"kl_cov needs kl_cov_ratio in (0, 1], got {params.kl_cov_ratio}")
    if not params.kl_cov_coef >= 0:
        raise ValueError(f"kl_cov needs kl_cov_coef >= 0, got {params.kl_cov_coef}")
    keep = mask.bool()
    log_ratio = _log_ratio(logprob, old_logprob, mask)
    ratio = log_ratio.exp()
    adv = torch.where(keep, advantages, torch.zeros_like(advantages))
    selected = kl_cov_select(token_covariance(logprob, adv, mask), mask, params)
    loss = -adv * ratio + params.kl_cov_coef * log_ratio.abs() * selected.to(logprob.dtype)
    return TokenLoss(loss=loss, clipped=selected, ratio=ratio)
