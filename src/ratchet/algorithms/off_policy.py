"""Off-policy corrections for rollouts made by a policy other than the one being trained
(an older version in `one_step_off` / `fully_async`, or the same weights in an inference
engine whose numerics differ from the trainer's).

Three log-probs per token are in play: the behaviour policy mu that sampled the token
(`rollout_logprob`, stored with the batch), the proximal / "old" policy pi_old (`old_logprob`,
recomputed by the trainer before the update) and the policy being trained pi. A correction
looks only at the first two, once per batch (no gradient), and returns per-token `weights` to
multiply into the policy loss and a `mask` of the tokens kept:

    out = POLICY_LOSSES.get(name)(logprob, old_logprob, adv, mask, params)
    corr = off_policy_correction(mode, old_logprob=old, rollout_logprob=rollout, mask=mask, cap=cap, level=level)
    loss = aggregate(out.loss * corr.weights, corr.mask, norm)

The log-ratio is log w = old_logprob - rollout_logprob, at a `level`:
- "token":     log w_t                              (per token)
- "sequence":  sum_t log w_t                        (the product of the token ratios)
- "geometric": (1/|y|) sum_t log w_t                (geometric mean; length-independent)
A sequence-level weight is the same on every token of the sequence.

All of it works in log space and exponentiates only bounded values, so log-ratios of
+-1000 (or +-inf) give finite weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .catalog import OFF_POLICY
from .kl import kl_low_var

LEVELS = ("token", "sequence", "geometric")
_LOG_CLAMP = 1e6  # finite stand-in for +-inf log-ratios; exp() is only applied to bounded values


@dataclass
class OffPolicyCorrection:
    weights: torch.Tensor  # [B, T] float, detached, 0 outside `mask`: multiply into the per-token loss
    mask: torch.Tensor  # [B, T] float: tokens kept (a subset of the input mask)
    metrics: dict[str, float] = field(default_factory=dict)
    # bypass: the trainer must use rollout_logprob as old_logprob in the policy loss (and may
    # skip recomputing old log-probs).
    use_rollout_as_old: bool = False


@dataclass
class Decision:
    """What a registered correction returns (see catalog.py)."""

    weights: torch.Tensor  # [B, T] before masking
    keep: torch.Tensor  # [B, T] bool
    truncated: torch.Tensor | None = None  # [B, T] bool (tis)
    use_rollout_as_old: bool = False


def level_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Token log-ratios [B, T] -> log-weights [B, T] at `level` (see the module docstring);
    0 outside the mask."""
    if level not in LEVELS:
        raise ValueError(f"unknown off-policy level {level!r}; one of: {', '.join(LEVELS)}")
    keep = mask.bool()
    lr = torch.where(keep, log_ratio.float().nan_to_num(0.0).clamp(-_LOG_CLAMP, _LOG_CLAMP), 0.0)
    if level == "token":
        return lr
    per_seq = lr.sum(-1)
    if level == "geometric":
        per_seq = per_seq / keep.sum(-1).clamp(min=1).to(per_seq.dtype)
    return torch.where(keep, per_seq.unsqueeze(-1).expand_as(lr), 0.0)


def no_correction(log_w: torch.Tensor, keep: torch.Tensor, cap: float) -> Decision:
    """No correction: weights 1, every token kept."""
    return Decision(weights=torch.ones_like(log_w), keep=keep)


def tis(log_w: torch.Tensor, keep: torch.Tensor, cap: float) -> Decision:
    """Truncated importance sampling (Ionides, 2008; for LLM rollout/trainer mismatch Yao et
    al., 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"):
    w = min(pi_old / mu, cap) at the configured level; tokens are never dropped."""
    if not cap > 0:
        raise ValueError(f"tis needs cap > 0, got {cap}")
    log_cap = math.log(cap)
    truncated = (log_w > log_cap) & keep
    return Decision(weights=log_w.clamp(max=log_cap).exp(), keep=keep, truncated=truncated)


def decoupled(log_w: torch.Tensor, keep: torch.Tensor, cap: float) -> Decision:
    """Decoupled PPO (Hilton et al., 2022, "Batch size-invariance for policy optimization",
    arXiv:2110.00641; AReaL, Fu et al., 2025, arXiv:2505.24298): the behaviour weight
    w = pi_prox / mu multiplies the PPO loss, whose ratio is taken against the proximal
    policy `old_logprob`; tokens with w > cap are *masked out* (AReaL's behav_imp_weight_cap),
    not truncated. AReaL's level is "token"."""
    if not cap > 0:
        raise ValueError(f"decoupled needs cap > 0, got {cap}")
    log_cap = math.log(cap)
    kept = keep & (log_w <= log_cap)
    return Decision(weights=log_w.clamp(max=log_cap).exp(), keep=kept)


def bypass(log_w: torch.Tensor, keep: torch.Tensor, cap: float) -> Decision:
    """Use the behaviour policy as the old policy: PPO's ratio becomes pi / mu, whose clip
    then also bounds the rollout/trainer mismatch. Weights 1; the trainer substitutes
    old_logprob := rollout_logprob."""
    return Decision(weights=torch.ones_like(log_w), keep=keep, use_rollout_as_old=True)


def rejection(log_w: torch.Tensor, keep: torch.Tensor, cap: float) -> Decision:
    """Rejection sampling: drop what has w outside [1/cap, cap]. With level "sequence" (the
    product of token ratios) or "geometric" (their geometric mean, recommended for long
    responses: a tiny per-token mismatch compounds over thousands of tokens in the product)
    whole sequences are dropped; with "token", single tokens. Weights 1 on what is kept."""
    if not cap >= 1:
        raise ValueError(f"rejection needs cap >= 1, got {cap}")
    log_cap = math.log(cap)
    kept = keep & (log_w <= log_cap) & (log_w >= -log_cap)
    return Decision(weights=torch.ones_like(log_w), keep=kept)


def off_policy_correction(
    mode: str,
    *,
    old_logprob: torch.Tensor | None,
    rollout_logprob: torch.Tensor | None,
    mask: torch.Tensor,
    cap: float = 2.0,
    level: str = "token",
) -> OffPolicyCorrection:
    """Weights and kept mask for `mode` (`algorithm.off_policy.mode`: none, tis, decoupled,
    bypass, rejection) with `cap` and `level` (`algorithm.off_policy.{cap,level}`).

    `old_logprob` may be None for "bypass", `rollout_logprob` may be None for "none" (then
    the rollout/trainer metrics are left out). Metrics (python floats; means over the input
    `mask` tokens unless said otherwise; multiply by mask.sum() to accumulate over
    micro-batches):
      is_weight_mean, is_weight_max: of the weights applied, over kept tokens (max: reduce
        by max, 0 when nothing is kept);
      frac_truncated: tokens whose weight was truncated at cap (tis);
      frac_masked: tokens dropped (decoupled, rejection);
      rollout_trainer_kl: k3 estimate of KL(mu || pi_old), mean of exp(d) - d - 1 with
        d = old - rollout (clamped as `low_var_kl`);
      rollout_trainer_k1: mean of rollout - old.
    """
    fn = OFF_POLICY.get(mode)
    keep = mask.bool()
    m = keep.float()
    have_both = old_logprob is not None and rollout_logprob is not None
    if have_both:
        log_ratio = old_logprob.detach().float() - rollout_logprob.detach().float()
    elif mode in ("none", "bypass"):
        log_ratio = torch.zeros_like(m)
    else:
        raise ValueError(f"off-policy mode {mode!r} needs both old_logprob and rollout_logprob")
    with torch.no_grad():
        log_w = level_log_ratio(log_ratio, keep, level)
        decision = fn(log_w, keep, cap)
        kept = (decision.keep & keep).float()
        weights = torch.where(kept.bool(), decision.weights.float(), torch.zeros_like(m))
        n = m.sum().clamp(min=1.0)
        n_kept = kept.sum()
        metrics = {
            "is_weight_mean": (weights.sum() / n_kept.clamp(min=1.0)).item(),
            "is_weight_max": weights.max().item() if weights.numel() else 0.0,
            "frac_truncated": 0.0 if decision.truncated is None else (decision.truncated & keep).float().sum().div(n).item(),
            "frac_masked": ((m - kept).sum() / n).item(),
        }
        if have_both:
            safe_old = torch.where(keep, old_logprob.detach().float(), 0.0)
            safe_rollout = torch.where(keep, rollout_logprob.detach().float(), 0.0)
            k3 = kl_low_var(safe_rollout, safe_old)
            metrics["rollout_trainer_kl"] = ((k3 * m).sum() / n).item()
            k1 = (safe_rollout - safe_old).nan_to_num(0.0).clamp(-_LOG_CLAMP, _LOG_CLAMP)
            metrics["rollout_trainer_k1"] = ((k1 * m).sum() / n).item()
    return OffPolicyCorrection(weights=weights, mask=kept, metrics=metrics, use_rollout_as_old=decision.use_rollout_as_old)
