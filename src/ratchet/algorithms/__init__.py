"""Pure torch RL algorithms: no I/O, no Ray, no Temporal. Selected by name through registries.
See docs/algorithms.md for the formulas, config keys and papers.

Every name a config can pick is listed in `ratchet/catalog/algorithms.py`: that is where an algorithm is added.
The catalog imports no torch, and neither does importing this package: the functions below
are imported on first use, so the config schema validates names without loading torch.
"""

from __future__ import annotations

from ratchet.lazy import lazy_exports

from ratchet.catalog.algorithms import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    OFF_POLICY,
    POLICY_LOSSES,
    AdvEstimator,
    register_adv_estimator,
    register_kl,
    register_loss_agg,
    register_off_policy,
    register_policy_loss,
)

# The torch-backed names, by the module that defines them (imported on first access).
_LAZY = {
    "advantages": (
        "AdvInputs",
        "AdvOutput",
        "AdvParams",
        "discounted_returns",
        "group_stats",
        "last_token_index",
        "masked_whiten",
        "remax_baselines",
        "response_span_lengths",
        "sequence_rewards_to_tokens",
    ),
    "advantages_outcome": ("sum_pi_squared",),
    "aggregation": ("Normaliser", "masked_mean"),
    "dapo": ("dynamic_sampling_keep", "overlong_penalty"),
    "kl": ("AdaptiveKLController", "apply_kl_in_reward", "kl_penalty"),
    "off_policy": ("OffPolicyCorrection", "level_log_ratio", "off_policy_correction"),
    "policy_losses": ("LossParams", "TokenLoss", "cispo_bounds", "entropy_from_logits", "value_clipped", "value_loss"),
}
_LAZY_NAMES, __getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = sorted(
    [
        "ADV_ESTIMATORS",
        "KL_ESTIMATORS",
        "LOSS_AGGREGATIONS",
        "OFF_POLICY",
        "POLICY_LOSSES",
        "AdvEstimator",
        "register_adv_estimator",
        "register_kl",
        "register_loss_agg",
        "register_off_policy",
        "register_policy_loss",
        *_LAZY_NAMES,
    ]
)
