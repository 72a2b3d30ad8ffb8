"""Pure torch RL algorithms: no I/O, no Ray, no Temporal. Selected by name through registries.
See docs/algorithms.md for the formulas, config keys and papers."""

from .advantages import (
    ADV_ESTIMATORS,
    AdvEstimator,
    AdvInputs,
    AdvOutput,
    AdvParams,
    discounted_returns,
    group_stats,
    masked_whiten,
    register_adv_estimator,
    sequence_rewards_to_tokens,
)
from .aggregation import LOSS_AGGREGATIONS, Normaliser, masked_mean, register_loss_agg
from .dapo import dynamic_sampling_keep, overlong_penalty
from .kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    kl_penalty,
    make_kl_controller,
    register_kl,
)
from .off_policy import OFF_POLICY, OffPolicyCorrection, level_log_ratio, off_policy_correction, register_off_policy
from .policy_losses import (
    POLICY_LOSSES,
    LossParams,
    TokenLoss,
    cispo_bounds,
    entropy_from_logits,
    register_policy_loss,
    value_clipped,
    value_loss,
)

__all__ = [
    "ADV_ESTIMATORS",
    "AdaptiveKLController",
    "AdvEstimator",
    "AdvInputs",
    "AdvOutput",
    "AdvParams",
    "FixedKLController",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "LossParams",
    "Normaliser",
    "OFF_POLICY",
    "OffPolicyCorrection",
    "POLICY_LOSSES",
    "TokenLoss",
    "apply_kl_in_reward",
    "cispo_bounds",
    "discounted_returns",
    "dynamic_sampling_keep",
    "entropy_from_logits",
    "group_stats",
    "kl_penalty",
    "level_log_ratio",
    "make_kl_controller",
    "masked_mean",
    "masked_whiten",
    "off_policy_correction",
    "overlong_penalty",
    "register_adv_estimator",
    "register_kl",
    "register_loss_agg",
    "register_off_policy",
    "register_policy_loss",
    "sequence_rewards_to_tokens",
    "value_clipped",
    "value_loss",
]
