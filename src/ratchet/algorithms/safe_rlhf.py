"""Safe-RLHF's Lagrangian: a multiplier that prices a cost against a budget, and the
advantage PPO trains on (Dai et al. 2023, "Safe RLHF: Safe Reinforcement Learning from
Human Feedback", arXiv:2310.12773, eq. 10-12).

The problem is  max_theta J_R(theta)  s.t.  J_C(theta) <= d  (d: the cost budget), solved
as the min-max of the Lagrangian  J_R - lambda (J_C - d)  over lambda >= 0:

- lambda climbs while the measured mean cost exceeds the budget and falls (to 0 at the
  least) while it is under it: `lagrange_update`. Two parameterisations, one gradient
  step each on the Lagrangian's lambda part, `-(J_C - d) * lambda`:
  `projected` (the brief's form, projected gradient ascent):
      lambda <- clip(lambda + lr (J_C - d), 0, lambda_max)
  `log` (PKU-Alignment/safe-rlhf, `safe_rlhf/algorithms/ppo_lag/trainer.py`: an SGD step
  on `log_lambda` with the loss `-(J_C - d) * exp(log_lambda)`, then `log_lambda` clamped
  to log(lambda_max)):
      log lambda <- log lambda + lr (J_C - d) lambda
  which stays positive and moves multiplicatively.
- the policy's advantage is the normalised mix (safe-rlhf's `actor_loss_fn`)
      A = (A_r - lambda A_c) / (1 + lambda)
  so its scale stays that of one advantage whatever lambda is.

Pure torch and floats, nothing internal: the trainer (workers/safety.py) computes A_r and
A_c with the configured estimator and calls these.
"""

from __future__ import annotations

import math

import torch

LAMBDA_UPDATES = ("projected", "log")


def lagrange_update(
    lam: float, mean_cost: float, budget: float, lr: float, *, mode: str = "projected", lam_max: float | None = None
) -> float:
    """The multiplier after one step on the measured mean cost `mean_cost` (J_C) against
    `budget` (d); never negative, never above `lam_max` (None: unbounded).

    `log` keeps a multiplier of 0 at 0 (log 0 = -inf): start it above 0."""
    if not (math.isfinite(lam) and math.isfinite(mean_cost) and math.isfinite(budget) and math.isfinite(lr)):
        raise ValueError(f"lagrange_update needs finite numbers, got lambda={lam}, mean_cost={mean_cost}, budget={budget}, lr={lr}")
    if lam < 0:
        raise ValueError(f"the multiplier must be >= 0, got {lam}")
    violation = mean_cost - budget
    if mode == "projected":
        new = max(0.0, lam + lr * violation)
    elif mode == "log":
        if lam == 0.0:
            return 0.0
        log_new = math.log(lam) + lr * violation * lam  # minus the gradient of -(J_C - d) exp(log lambda)
        new = math.exp(min(log_new, 700.0))  # exp(709) overflows a float; lam_max clamps below
    else:
        raise ValueError(f"unknown multiplier update {mode!r}; use one of {', '.join(LAMBDA_UPDATES)}")
    return min(new, lam_max) if lam_max is not None else new


def lagrangian_lambda_loss(lam_param: torch.Tensor, mean_cost: float, budget: float, *, mode: str = "projected") -> torch.Tensor:
    """The lambda part of the Lagrangian as a loss to minimise over the multiplier's
    parameter (lambda itself, or log lambda): `-(J_C - d) * lambda`. One gradient step of
    size lr on it is `lagrange_update` (before projection or clamping); kept for tests and
    for a caller that steps lambda with an optimizer of its own."""
    lam = lam_param.exp() if mode == "log" else lam_param
    return -(mean_cost - budget) * lam


def combined_advantages(reward_adv: torch.Tensor, cost_adv: torch.Tensor, lam: float) -> torch.Tensor:
    """(A_r - lambda A_c) / (1 + lambda), elementwise (Safe-RLHF's normalised mix)."""
    if lam < 0 or not math.isfinite(lam):
        raise ValueError(f"the multiplier must be a finite number >= 0, got {lam}")
    return (reward_adv - lam * cost_adv) / (1.0 + lam)
