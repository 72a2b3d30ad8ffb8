"""Pure torch RL algorithms: no I/O, no Ray, no Temporal. Selected by name through registries."""

from .advantages import (
    ADV_ESTIMATORS,
    AdvInputs,
    AdvOutput,
    AdvParams,
    group_stats,
    register_adv_estimator,
    sequence_rewards_to_tokens,
)
from .aggregation import LOSS_AGGREGATIONS, Normaliser, masked_mean, register_loss_agg
from .kl import KL_ESTIMATORS, kl_penalty, register_kl
from .policy_losses import POLICY_LOSSES, LossParams, TokenLoss, register_policy_loss

__all__ = [
    "ADV_ESTIMATORS",
    "AdvInputs",
    "AdvOutput",
    "AdvParams",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "LossParams",
    "Normaliser",
    "POLICY_LOSSES",
    "TokenLoss",
    "group_stats",
    "kl_penalty",
    "sequence_rewards_to_tokens",
    "masked_mean",
    "register_adv_estimator",
    "register_kl",
    "register_loss_agg",
    "register_policy_loss",
]
