"""KL estimators between the policy and the reference policy, per token.

With r = ref_logprob - logprob (the log-ratio under samples from the policy),
k1 = -r, abs = |r|, mse (k2) = r^2 / 2, low_var_kl (k3) = exp(r) - r - 1 (Schulman,
"Approximating KL divergence", 2020). k3 is unbiased, non-negative and low-variance; it is
clamped to [-10, 10] because exp(r) overflows for extreme log-ratios.
"""

from __future__ import annotations

import torch

from .registry import Registry, decorator

KL_ESTIMATORS: Registry = Registry("KL estimator", "algorithm.kl.type")


def register_kl(name: str):
    return decorator(KL_ESTIMATORS, name)


@register_kl("k1")
def kl_k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return logprob - ref_logprob


@register_kl("abs")
def kl_abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return (logprob - ref_logprob).abs()


@register_kl("mse")
def kl_mse(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprob - ref_logprob).square()


@register_kl("low_var_kl")
def kl_low_var(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    log_ratio = (ref_logprob - logprob).clamp(-20.0, 20.0)
    return (log_ratio.exp() - log_ratio - 1.0).clamp(-10.0, 10.0)


def kl_penalty(kind: str, logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return KL_ESTIMATORS.get(kind)(logprob, ref_logprob)
