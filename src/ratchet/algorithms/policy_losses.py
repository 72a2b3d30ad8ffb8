"""Policy-gradient losses. Each returns the per-token loss matrix and per-token clip
indicators; aggregation to a scalar is a separate, registered choice (aggregation.py).
Each loss is registered by its line in catalog/algorithms.py."""

from __future__ import annotations

from typing import Any

from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class LossParams:
    """Hyper-parameters of every registered policy loss (each loss reads the fields it needs).

    - `clip_ratio_low`, `clip_ratio_high`: PPO/GSPO clip range [1 - low, 1 + high]
      (`algorithm.clip_ratio_low/high`).
    - `clip_ratio_c`: dual-clip bound c > 1 for negative advantages (`algorithm.clip_ratio_c`).
    - `cispo_clip_low`, `cispo_clip_high`: CISPO's IS-weight bounds [1 - low, 1 + high].
      `None` (default) means: no lower bound (the weight is only kept >= 0, as MiniMax-M1) and
      the upper bound 1 + `clip_ratio_high`.
    - The losses from the rest of verl's catalogue (policy_losses_verl.py, policy_losses_cov.py)
      read `sapo_tau_pos/neg` (SAPO), `dro_beta` (DRO), `dppo_is_cap` (DPPO-TV/KL),
      `clip_cov_ratio/lb/ub` (Clip-Cov), `kl_cov_ratio`, `kl_cov_coef` (KL-Cov) and
      `reinforce_is_cap/level` (REINFORCE with IS weights); defaults are verl's, each field
      is described on `AlgorithmConfig` (src/ratchet/config/schema.py) under the same name.
    """

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    cispo_clip_low: float | None = None
    cispo_clip_high: float | None = None
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    dro_beta: float = 0.1
    dppo_is_cap: float = 20.0
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    kl_cov_coef: float = 0.1
    reinforce_is_cap: float = 2.0
    reinforce_is_level: str = "token"

    @classmethod
    def from_algorithm(cls, alg: object) -> "LossParams":
        """The fields of the config's `algorithm` section with the same names (read by
        attribute, so a pydantic-free config view works); a field the section lacks keeps
        its default."""
        values: dict[str, Any] = {f.name: getattr(alg, f.name, f.default) for f in fields(cls)}
        return cls(**values)


@dataclass
class TokenLoss:
    loss: torch.Tensor  # [B, T], before masking
    clipped: torch.Tensor  # [B, T] bool: the clip bound was active for this token
    ratio: torch.Tensor  # [B, T] importance ratio pi / pi_old
    # [B, T] bool, dual_clip only: the dual-clip bound -A * c was active (A < 0). None elsewhere.
    dual_clipped: torch.Tensor | None = None


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


LOG_RATIO_CLAMP = 20.0


def _log_ratio(logprob: torch.Tensor, old_logprob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log pi - log pi_old, clamped to +-20, and 0 outside the mask (so padding never makes NaN)."""
    diff = (logprob - old_logprob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(mask.bool(), diff, torch.zeros_like(diff))


def dual_clip(
    logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, params: LossParams
) -> TokenLoss:
    """Dual-clip PPO (Ye et al., 2020, "Mastering Complex Control in MOBA Games with Deep RL",
    arXiv:1912.09729): PPO's clipped loss, plus, for A < 0, an upper bound on the loss:

        L_clip = max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A)
        L = min(L_clip, -c A)  if A < 0,   L_clip otherwise       (c = clip_ratio_c > 1)

    so a very large ratio on a bad token cannot produce an unbounded loss (its gradient is 0
    beyond r = c). `clipped` flags the PPO bound, `dual_clipped` the -c A bound.
    """
    c = params.clip_ratio_c
    if not c > 1.0:
        raise ValueError(f"dual-clip needs clip_ratio_c > 1, got {c}")
    ratio = _log_ratio(logprob, old_logprob, mask).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    loss_clip = torch.maximum(unclipped, clipped)
    bound = -advantages * c
    negative = advantages < 0
    loss = torch.where(negative, torch.minimum(loss_clip, bound), loss_clip)
    keep = mask.bool()
    return TokenLoss(
        loss=loss,
        clipped=(clipped > unclipped) & keep,
        ratio=ratio,
        dual_clipped=(loss_clip > bound) & negative & keep,
    )


def gspo(logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, params: LossParams) -> TokenLoss:
    """GSPO, token form (Zheng et al., 2025, "Group Sequence Policy Optimization",
    arXiv:2507.18071). The importance ratio is per *sequence*, length-normalised:

        s_i = exp( (1/|y_i|) sum_t (log pi - log pi_old) )       (masked mean, clamped +-20)
        s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]                    (value s_i, gradient per token)
        L_i,t = max(-s_i,t A_i,t, -clip(s_i,t, 1 - eps_low, 1 + eps_high) A_i,t)

    Clip ranges are tiny compared with PPO: the paper uses eps_low = 3e-4, eps_high = 4e-4
    (set `algorithm.clip_ratio_low/high`). With `seq-mean-token-mean` aggregation the
    gradient is exactly GSPO's (1/|y_i|) sum_t s_i A_i grad log pi; that is the paper's and
    verl's choice. A whole sequence is clipped or not: `clipped` is per sequence, broadcast.
    """
    keep = mask.bool()
    diff = torch.where(keep, (logprob - old_logprob).clamp(-1e6, 1e6), torch.zeros_like(logprob))
    lengths = keep.sum(-1).clamp(min=1).to(diff.dtype)
    seq_log_ratio = (diff.sum(-1) / lengths).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    token_logprob = torch.where(keep, logprob, torch.zeros_like(logprob))  # padding: no gradient, no NaN
    log_ratio = token_logprob - token_logprob.detach() + seq_log_ratio.unsqueeze(-1)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    return TokenLoss(loss=loss, clipped=(clipped > unclipped) & keep, ratio=ratio)


def cispo_bounds(params: LossParams) -> tuple[float, float]:
    """CISPO's IS-weight bounds (low, high) from `params` (see LossParams)."""
    low = 0.0 if params.cispo_clip_low is None else max(1.0 - params.cispo_clip_low, 0.0)
    high = 1.0 + (params.clip_ratio_high if params.cispo_clip_high is None else params.cispo_clip_high)
    return low, high


def cispo(logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, params: LossParams) -> TokenLoss:
    """CISPO (MiniMax, 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
    Attention", arXiv:2506.13585): clip the importance-sampling *weight*, never drop a
    token's gradient:

        L_t = -sg[clip(r_t, lo, hi)] * A_t * log pi(y_t),      r_t = pi / pi_old

    with lo = 1 - cispo_clip_low and hi = 1 + cispo_clip_high. Defaults: no lower bound
    (lo = 0; the paper sets eps_low^IS large) and hi = 1 + clip_ratio_high (e.g. 0.28 gives
    1.28). The gradient is -clip(r) A grad log pi for every token; the loss *value* is not a
    surrogate objective (it scales with log pi), only its gradient is meaningful.
    `clipped` flags tokens whose weight was clipped.
    """
    low, high = cispo_bounds(params)
    ratio = _log_ratio(logprob, old_logprob, mask).exp()
    weight = ratio.detach().clamp(low, high)
    safe_logprob = torch.where(mask.bool(), logprob, torch.zeros_like(logprob))
    loss = -weight * advantages * safe_logprob
    clipped = ((ratio > high) | (ratio < low)) & mask.bool()
    return TokenLoss(loss=loss, clipped=clipped, ratio=ratio)


# --------------------------------------------------------------------------- critic, entropy


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip_range: float
) -> torch.Tensor:
    """Clipped value loss per token (PPO, Schulman et al., 2017; as in verl/OpenAI baselines):

        v_clip = clip(v, v_old - c, v_old + c)
        L = 0.5 * max((v - R)^2, (v_clip - R)^2)

    Zero outside the mask; aggregate it like the policy loss. See `value_clipped` for the
    clip-fraction metric.
    """
    v_clip = old_values + (values - old_values).clamp(-clip_range, clip_range)
    loss = 0.5 * torch.maximum((values - returns).square(), (v_clip - returns).square())
    return torch.where(mask.bool(), loss, torch.zeros_like(loss))


def value_clipped(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip_range: float
) -> torch.Tensor:
    """[B, T] bool: the clipped term was the larger one (the value gradient is 0 there)."""
    v_clip = old_values + (values - old_values).clamp(-clip_range, clip_range)
    return ((v_clip - returns).square() > (values - returns).square()) & mask.bool()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension, H = -sum_v p_v log p_v, in float32
    from log_softmax (shift-invariant, so large logits lose no precision); -inf logits
    (a masked vocabulary) contribute 0."""
    logp = logits.float().log_softmax(-1)
    p = logp.exp()
    return -torch.where(p > 0, p * logp, torch.zeros_like(logp)).sum(-1)
