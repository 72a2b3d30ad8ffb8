"""Policy losses without PPO's hard ratio clip, from the rest of verl's catalogue: SAPO's soft
gate, GMPO's geometric mean, DPPO's divergence masks, DRO's quadratic penalty and REINFORCE
with truncated importance weights.

Each follows its verl function (verl/trainer/ppo/core_algos.py, `compute_policy_loss_*`) and
shares the signature of policy_losses.py: `fn(logprob, old_logprob, advantages, mask,
LossParams) -> TokenLoss`, a per-token loss that aggregation (aggregation.py) turns into a
scalar. Unlike verl, the functions do not aggregate: each docstring names the aggregation
that gives the paper's objective. Padding may hold any value (-inf, NaN): every per-token
output is finite and padded positions get no gradient. Registered by their lines in
catalog/algorithms.py; the differences from verl are listed in docs/algorithms.md.
"""

from __future__ import annotations

import torch

from .policy_losses import LossParams, TokenLoss, _log_ratio

LOG_RATIO_CLAMP = 20.0


def _zero_outside(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """`x` on kept tokens, 0 elsewhere (where(), not a product: -inf * 0 would be NaN)."""
    return torch.where(keep, x, torch.zeros_like(x))


def _no_flags(mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(mask, dtype=torch.bool)


# --------------------------------------------------------------------------------------- SAPO


def sapo_gate(ratio: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """SAPO's soft gate f(r) = sigmoid(tau (r - 1)) * 4 / tau: value 2/tau and slope 1 at r = 1."""
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


def sapo(logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, params: LossParams) -> TokenLoss:
    """SAPO (Gao et al., 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347; verl
    `compute_policy_loss_sapo`): a smooth, temperature-controlled gate instead of a hard clip.

        tau_t = tau_pos if A_t > 0 else tau_neg
        L_t = -f(r_t, tau_t) A_t,     f(r, tau) = sigmoid(tau (r - 1)) * 4 / tau

    Its gradient is -4 sigmoid(.)(1 - sigmoid(.)) r A grad log pi: exactly the policy gradient
    at r = 1, decaying smoothly (never to zero) as r leaves 1; tau_neg > tau_pos damps
    negative-advantage tokens faster (verl's defaults 1.0 and 1.05). No token is clipped, so
    `clipped` is all False. verl aggregates with `seq-mean-token-mean` (the paper's sequence
    average); pair it with that mode.
    """
    if not (params.sapo_tau_pos > 0 and params.sapo_tau_neg > 0):
        raise ValueError(f"sapo needs sapo_tau_pos and sapo_tau_neg > 0, got {params.sapo_tau_pos}, {params.sapo_tau_neg}")
    keep = mask.bool()
    ratio = _log_ratio(logprob, old_logprob, mask).exp()
    adv = _zero_outside(advantages, keep)
    tau = torch.where(adv > 0, params.sapo_tau_pos, params.sapo_tau_neg).to(ratio.dtype)
    loss = -sapo_gate(ratio, tau) * adv
    return TokenLoss(loss=loss, clipped=_no_flags(mask), ratio=ratio)


# --------------------------------------------------------------------------------------- GMPO


def gmpo(logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, params: LossParams) -> TokenLoss:
    """GMPO (Zhao et al., 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673; verl
    `compute_policy_loss_geo_mean`, registered there as `geo_mean`): the sequence's ratio is the
    geometric mean of its token ratios, each clipped in log space on the pessimistic side:

        d_t = log r_t,   d~_t = sgn(A_t) * min(sgn(A_t) d_t, sgn(A_t) clip(d_t, -eps_low, eps_high))
        R_i = exp( (1/|y_i|) sum_t m_t d~_t ),   A_i = (1/|y_i|) sum_t m_t A_t
        L_i = -A_i R_i

    The clip range is on log r (`clip_ratio_low/high`; the paper uses 0.4 for both, i.e.
    r in (e^-0.4, e^0.4)). Sequence-level: every token of sequence i carries the same L_i, so
    `seq-mean-token-mean` aggregation gives exactly verl's mean over sequences (verl also
    counts empty responses in the mean; here they are left out, as every mode does) and the
    paper's gradient -(A_i R_i / |y_i|) sum_t grad d~_t. `clipped` flags the tokens whose
    clip was active (their gradient is 0): d_t > eps_high with A > 0, d_t < -eps_low with A < 0.
    `ratio` is R_i, broadcast over the sequence.
    """
    keep = mask.bool()
    m = mask.to(logprob.dtype)
    d = _log_ratio(logprob, old_logprob, mask)
    adv = _zero_outside(advantages, keep)
    sign = torch.sign(adv)
    d_clip = d.clamp(-params.clip_ratio_low, params.clip_ratio_high)
    d_min = sign * torch.minimum(sign * d, sign * d_clip)
    lengths = m.sum(-1).clamp(min=1.0)
    seq_ratio = ((d_min * m).sum(-1) / lengths).exp()
    seq_adv = (adv * m).sum(-1) / lengths
    loss = (-seq_adv * seq_ratio).unsqueeze(-1).expand_as(logprob)
    clipped = (sign * d_clip < sign * d) & keep
    return TokenLoss(loss=loss, clipped=clipped, ratio=seq_ratio.unsqueeze(-1).expand_as(logprob))


# --------------------------------------------------------------------------------------- DPPO


def _dppo(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    params: LossParams,
    valid_fn,
) -> TokenLoss:
    """DPPO's shared form: L_t = -A_t * sg[min(r_t, cap)] * valid_t * log pi(y_t)."""
    keep = mask.bool()
    if not params.dppo_is_cap > 0:
        raise ValueError(f"dppo needs dppo_is_cap > 0, got {params.dppo_is_cap}")
    ratio = _log_ratio(logprob, old_logprob, mask).exp()
    safe_logprob = _zero_outside(logprob, keep)
    adv = _zero_outside(advantages, keep)
    with torch.no_grad():
        prob = safe_logprob.exp()
        old_prob = _zero_outside(old_logprob, keep).exp()
        valid = valid_fn(prob, old_prob, safe_logprob, _zero_outside(old_logprob, keep), adv) & keep
    weight = ratio.detach().clamp(max=params.dppo_is_cap)
    loss = -adv * weight * valid.to(logprob.dtype) * safe_logprob
    return TokenLoss(loss=loss, clipped=~valid & keep, ratio=ratio)


def dppo_tv(
    logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, params: LossParams
) -> TokenLoss:
    """DPPO-Binary-TV (Qi et al., 2026, "Rethinking the Trust Region in LLM Reinforcement
    Learning", arXiv:2602.04879; verl `compute_policy_loss_dppo_tv`): the trust region is a
    bound on the change of the sampled token's probability (its binary total variation), not on
    the ratio, so low-probability tokens are not over-clipped:

        valid_t = (p - p_old <= delta_high) if A_t > 0 else (p - p_old >= -delta_low)
        L_t = -A_t * sg[min(r_t, cap)] * valid_t * log pi(y_t)

    delta_low/high are `clip_ratio_low/high` (reinterpreted as TV thresholds, as verl does);
    cap is `dppo_is_cap` (truncated IS instead of dual-clip; see LossParams). Only the gradient
    is meaningful (the value scales with log pi, as CISPO's). `clipped` flags tokens outside
    the trust region (no gradient). Any aggregation; verl's default is `token-mean`.
    """

    def valid(prob, old_prob, _lp, _old_lp, adv):
        return torch.where(adv > 0, prob - old_prob <= params.clip_ratio_high, prob - old_prob >= -params.clip_ratio_low)

    return _dppo(logprob, old_logprob, advantages, mask, params, valid)


def binary_kl(prob: torch.Tensor, old_prob: torch.Tensor, logprob: torch.Tensor, old_logprob: torch.Tensor) -> torch.Tensor:
    """KL(Bernoulli(p_old) || Bernoulli(p)) of "this token vs the rest", as verl (1e-8 guards p = 1)."""
    return old_prob * (old_logprob - logprob) + (1.0 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))


def dppo_kl(
    logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, params: LossParams
) -> TokenLoss:
    """DPPO-Binary-KL (Qi et al., 2026, arXiv:2602.04879; verl `compute_policy_loss_dppo_kl`):
    DPPO with the binary KL as the divergence:

        D_t = p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p))
        valid_t = (D_t <= delta_high or p <= p_old) if A_t > 0 else (D_t <= delta_low or p >= p_old)
        L_t = -A_t * sg[min(r_t, cap)] * valid_t * log pi(y_t)

    A token is masked only when it moved past the threshold in the direction its advantage
    pushes (moving back is always allowed). delta_low/high are `clip_ratio_low/high`, cap is
    `dppo_is_cap`. `clipped` flags the masked tokens.
    """

    def valid(prob, old_prob, lp, old_lp, adv):
        div = binary_kl(prob, old_prob, lp, old_lp)
        pos = (div <= params.clip_ratio_high) | (prob <= old_prob)
        neg = (div <= params.clip_ratio_low) | (prob >= old_prob)
        return torch.where(adv > 0, pos, neg)

    return _dppo(logprob, old_logprob, advantages, mask, params, valid)


# ---------------------------------------------------------------------------------------- DRO


def dro(logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, params: LossParams) -> TokenLoss:
    """DRO's policy loss (Richemond et al., 2024, "Offline Regularised Reinforcement Learning for
    Large Language Models Alignment", arXiv:2405.19107; the squared log-ratio form of Kimi k1.5,
    Kimi Team 2025, arXiv:2501.12599; verl's `dro` loss, PR #7245, and Tinker's `dro`):

        L_t = -( A_t log pi(y_t) - (beta / 2) (log pi(y_t) - log pi_old(y_t))^2 )

    A quadratic proximal penalty instead of a clip: the gradient -(A_t - beta d_t) grad log pi
    pulls the log-ratio d_t back toward 0 with strength `dro_beta` (> 0), so the policy can
    learn off-policy without drifting far from the sampler. The penalty uses the unclamped
    log-ratio (a clamp would switch the restoring force off exactly when it matters); finite
    log-probs give a finite loss. No clip: `clipped` is all False. Any aggregation (Tinker sums
    over tokens; `token-mean` is the default).
    """
    if not params.dro_beta > 0:
        raise ValueError(f"dro needs dro_beta > 0, got {params.dro_beta}")
    keep = mask.bool()
    safe_logprob = _zero_outside(logprob, keep)
    d = safe_logprob - _zero_outside(old_logprob, keep)
    adv = _zero_outside(advantages, keep)
    loss = -(adv * safe_logprob - 0.5 * params.dro_beta * d.square())
    ratio = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    return TokenLoss(loss=loss, clipped=_no_flags(mask), ratio=ratio)


# ------------------------------------------------------------------------ REINFORCE + IS weights


def reinforce_is(
    logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, params: LossParams
) -> TokenLoss:
    """REINFORCE with truncated importance weights (Williams, 1992; verl
    `compute_policy_loss_reinforce` as called by `compute_policy_loss_bypass_mode` with
    `loss_type=reinforce`, weights from rollout_corr_helper's truncated IS):

        w = sg[min(rho, cap)],   rho = r_t (level token) or prod_t r_t (level sequence)
        L_t = -w A_t log pi(y_t)

    No clip: the gradient is -w A grad log pi for every token. The weight corrects for the
    policy that produced the samples, so pair it with `algorithm.off_policy.mode=bypass`
    (old_logprob is then the rollout engine's log-probs, as in verl's bypass mode); with a
    recomputed old policy it is plain REINFORCE in the first epoch (w = 1). cap is
    `reinforce_is_cap` (verl's `rollout_is_threshold`, 2.0), level `reinforce_is_level`.
    `clipped` flags tokens (or whole sequences) whose weight was truncated. verl's default
    aggregation is `seq-mean-token-sum`. The loss value scales with log pi: only its gradient
    is meaningful.
    """
    if not params.reinforce_is_cap > 0:
        raise ValueError(f"reinforce_is needs reinforce_is_cap > 0, got {params.reinforce_is_cap}")
    if params.reinforce_is_level not in ("token", "sequence"):
        raise ValueError(f"reinforce_is_level must be 'token' or 'sequence', got {params.reinforce_is_level!r}")
    keep = mask.bool()
    d = _log_ratio(logprob, old_logprob, mask)
    if params.reinforce_is_level == "sequence":
        log_rho = d.sum(-1, keepdim=True).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).expand_as(d)
    else:
        log_rho = d
    rho = log_rho.detach().exp()
    weight = rho.clamp(max=params.reinforce_is_cap)
    safe_logprob = _zero_outside(logprob, keep)
    loss = -weight * _zero_outside(advantages, keep) * safe_logprob
    return TokenLoss(loss=loss, clipped=(rho > params.reinforce_is_cap) & keep, ratio=d.exp())
