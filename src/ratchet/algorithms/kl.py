"""KL estimators between the policy and the reference policy, per token.

With r = ref_logprob - logprob (the log-ratio under samples from the policy),
k1 = -r, abs = |r|, mse (k2) = r^2 / 2, low_var_kl (k3) = exp(r) - r - 1 (Schulman,
"Approximating KL divergence", 2020). k3 is unbiased, non-negative and low-variance; it is
clamped to [-10, 10] because exp(r) overflows for extreme log-ratios.

Aliases: "k2" = "mse", "k3" = "low_var_kl". Straight-through variants "<name>+" (verl's
"k1+", "k3+", ...): the forward value of the base estimator with the gradient of k2,
d/dlogprob = logprob - ref_logprob, whose expectation under on-policy samples is the gradient
of KL(pi || ref); used directly as loss terms, k1 and k3 give biased gradients (Tang & Munos,
2025, "On a few pitfalls in KL divergence gradient estimation for RL").

The names a config uses (aliases and "+" variants included) are listed in catalog/algorithms.py.

`AdaptiveKLController` (Ziegler et al., 2019, arXiv:1909.08593) adapts the coefficient when
`algorithm.kl.target` is set; without a target the coefficient simply stays `algorithm.kl.coef`.
It is a plain dataclass holding floats: `coef` is its whole mutable state (`state()` /
`load_state(coef)`), so a workflow can carry it durably.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ratchet.catalog.algorithms import KL_ESTIMATORS


def kl_k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return logprob - ref_logprob


def kl_abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return (logprob - ref_logprob).abs()


def kl_mse(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprob - ref_logprob).square()


def kl_low_var(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    log_ratio = (ref_logprob - logprob).clamp(-20.0, 20.0)
    return (log_ratio.exp() - log_ratio - 1.0).clamp(-10.0, 10.0)


def straight_through(base):
    """Estimator with `base`'s forward value and the gradient of k2 = (logprob - ref)^2 / 2.

    Written as fwd.detach() + d.detach() * (d - d.detach()) with d = logprob - ref_logprob:
    the second term is exactly 0 in value and has gradient d (verl writes the same as
    k2 - k2.detach() + fwd.detach(); this form never squares d, so it cannot overflow)."""

    def estimator(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
        forward = base(logprob, ref_logprob).detach()
        d = logprob - ref_logprob
        return forward + d.detach() * (d - d.detach())

    estimator.__name__ = f"{base.__name__}_straight_through"
    estimator.__doc__ = f"Straight-through: value of {base.__name__}, gradient of k2."
    return estimator


kl_k1_straight_through = straight_through(kl_k1)
kl_abs_straight_through = straight_through(kl_abs)
kl_mse_straight_through = straight_through(kl_mse)
kl_low_var_straight_through = straight_through(kl_low_var)


def kl_penalty(kind: str, logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return KL_ESTIMATORS.get(kind)(logprob, ref_logprob)


def apply_kl_in_reward(
    token_rewards: torch.Tensor,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL as a reward penalty (InstructGPT / verl `use_kl_in_reward`): on response tokens,

        r'_t = r_t - coef * kl_t,    kl_t = KL_ESTIMATORS[kind](logprob_t, ref_logprob_t),

    with `logprob` the behaviour/old policy's log-probs. Returns (r', mean_kl) where mean_kl
    (0-dim, detached) is verl's `current_kl`: the per-sequence token mean of kl_t averaged
    over non-empty sequences (0 for an all-empty batch); feed float(mean_kl) to a controller's
    `update`. Nothing here carries gradient. Outside the mask r' = r.
    """
    keep = mask.bool()
    with torch.no_grad():
        kl = kl_penalty(kind, logprob.detach(), ref_logprob.detach())
        kl = torch.where(keep, kl, torch.zeros_like(kl))
        penalised = token_rewards - coef * kl.to(token_rewards.dtype)
        lengths = keep.sum(-1)
        per_seq = kl.sum(-1) / lengths.clamp(min=1).to(kl.dtype)
        nonempty = (lengths > 0).to(kl.dtype)
        mean_kl = (per_seq * nonempty).sum() / nonempty.sum().clamp(min=1.0)
    return penalised, mean_kl


# --------------------------------------------------------------------------- controllers


@dataclass
class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al., 2019, "Fine-Tuning Language Models from Human
    Preferences", arXiv:1909.08593), as verl's AdaptiveKLController:

        e = clip(current_kl / target - 1, -0.2, 0.2)
        coef <- coef * (1 + e * n_steps / horizon)

    `n_steps` is the number of samples (sequences) the KL was measured on, `horizon` the
    number of samples over which the error should close. `coef` starts at `init_coef` and is
    the only state (`state()` -> float, `load_state(float)`, or pass `coef=` to construct).
    Pure Python: no torch, deterministic.
    """

    init_coef: float
    target: float
    horizon: float
    coef: float | None = None

    def __post_init__(self) -> None:
        if not self.target > 0:
            raise ValueError(f"adaptive KL needs target > 0, got {self.target}")
        if not self.horizon > 0:
            raise ValueError(f"adaptive KL needs horizon > 0, got {self.horizon}")
        self.coef = float(self.init_coef if self.coef is None else self.coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.coef = self.state() * (1.0 + error * n_steps / self.horizon)
        return self.coef

    def state(self) -> float:
        assert self.coef is not None  # set in __post_init__
        return float(self.coef)

    def load_state(self, coef: float) -> None:
        self.coef = float(coef)
