"""Pure torch RL algorithms: no I/O, no Ray, no Temporal. Selected by name through registries.
See docs/algorithms.md for the formulas, config keys and papers.

Every name a config can pick is listed in `ratchet/catalog/algorithms.py`: that is where an algorithm is added.
The catalog imports no torch, and neither does this package's `__init__`, which holds the
catalog's tables only: import a function from the module that defines it
(`ratchet.algorithms.advantages`, `.policy_losses`, `.kl`, ...), so the config schema
validates names without loading torch.
"""

from __future__ import annotations

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

__all__ = [
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
]
