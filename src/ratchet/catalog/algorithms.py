"""Every algorithm a config can name, in one list: where to add one.

To add, say, an advantage estimator: write the function next to the others of its kind
(`advantages.py`, with the shared signature), add its line below with its flags, and test
it by hand-worked numbers in tests/unit/algorithms/. The line is the registration; the
config schema, the trainer and the error messages all read these registries.

This module imports no torch: an entry names its implementation as "module:function",
imported on first use (`Registry.get`, `AdvEstimator.fn`). So the config schema validates
names, and reads an estimator's flags, in a client or CLI process that never loads torch.
tests/unit/algorithms/test_catalog.py::test_catalog_matches_implementations imports every entry, so a
misspelt or missing function fails there rather than in a run.

Code outside ratchet can add its own with the `register_*` decorators (before the config
is validated, so the schema accepts the new name).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Callable

from .registry import Registry, decorator, resolve


def register_all(registry: Registry, module: str, functions: dict[str, str]) -> None:
    """Register each config name -> `module:function`, imported on first use."""
    for name, function in functions.items():
        registry.register(name, f"{module}:{function}")


if TYPE_CHECKING:
    from ratchet.algorithms.advantages import AdvInputs, AdvOutput, AdvParams


@dataclass(frozen=True)
class AdvEstimator:
    """An advantage estimator and what it needs besides rewards, mask and group ids."""

    impl: Callable | str  # the function, or "module:function" (imported on first use of `fn`)
    needs_group: bool = False  # AdvInputs.group: several samples per prompt (rollout.n >= 2)
    needs_critic: bool = False  # AdvInputs.values: a critic is trained alongside
    needs_baseline: bool = False  # AdvInputs.baseline_rewards: a greedy response per prompt is scored
    needs_sum_pi_squared: bool = False  # AdvInputs.old_logprob and .sum_pi_squared over the whole batch (OTB)

    @property
    def fn(self) -> Callable[["AdvInputs", "AdvParams"], "AdvOutput"]:
        return resolve(self.impl)


# --------------------------------------------------------------------------- advantage estimators
# algorithm.adv_estimator; fn(AdvInputs, AdvParams) -> AdvOutput

ADV_ESTIMATORS: Registry[AdvEstimator] = Registry("advantage estimator")
_ADV = "ratchet.algorithms.advantages:"
ADV_ESTIMATORS.register("grpo", AdvEstimator(_ADV + "grpo", needs_group=True))
ADV_ESTIMATORS.register("rloo", AdvEstimator(_ADV + "rloo", needs_group=True))
ADV_ESTIMATORS.register("gae", AdvEstimator(_ADV + "gae", needs_critic=True))
ADV_ESTIMATORS.register("reinforce_plus_plus", AdvEstimator(_ADV + "reinforce_plus_plus"))
ADV_ESTIMATORS.register("reinforce_plus_plus_baseline", AdvEstimator(_ADV + "reinforce_plus_plus_baseline", needs_group=True))
ADV_ESTIMATORS.register("remax", AdvEstimator(_ADV + "remax", needs_baseline=True))
_ADV_OUTCOME = "ratchet.algorithms.advantages_outcome:"
ADV_ESTIMATORS.register("opo", AdvEstimator(_ADV_OUTCOME + "opo", needs_group=True))
ADV_ESTIMATORS.register("gpg", AdvEstimator(_ADV_OUTCOME + "gpg", needs_group=True))
ADV_ESTIMATORS.register("grpo_passk", AdvEstimator(_ADV_OUTCOME + "grpo_passk", needs_group=True))
_OTB = AdvEstimator(_ADV_OUTCOME + "optimal_token_baseline", needs_group=True, needs_sum_pi_squared=True)
ADV_ESTIMATORS.register("optimal_token_baseline", _OTB)
ADV_ESTIMATORS.register("tir_optimal_token_baseline", _OTB)  # verl's multi-turn name: this OTB already skips holes


def register_adv_estimator(
    name: str, *, needs_group: bool = False, needs_critic: bool = False, needs_baseline: bool = False, needs_sum_pi_squared: bool = False
):
    return decorator(ADV_ESTIMATORS, name, lambda fn: AdvEstimator(fn, needs_group, needs_critic, needs_baseline, needs_sum_pi_squared))


# --------------------------------------------------------------------------- policy losses
# algorithm.policy_loss; fn(logprob, old_logprob, advantages, mask, LossParams) -> TokenLoss

POLICY_LOSSES: Registry[Callable] = Registry("policy loss")
register_all(
    POLICY_LOSSES, "ratchet.algorithms.policy_losses", {"ppo_clip": "ppo_clip", "dual_clip": "dual_clip", "gspo": "gspo", "cispo": "cispo"}
)
# The rest of verl's catalogue; "geo_mean" is verl's name for GMPO.
register_all(
    POLICY_LOSSES,
    "ratchet.algorithms.policy_losses_verl",
    {
        "sapo": "sapo",
        "gmpo": "gmpo",
        "geo_mean": "gmpo",
        "dppo_tv": "dppo_tv",
        "dppo_kl": "dppo_kl",
        "dro": "dro",
        "reinforce_is": "reinforce_is",
    },
)
register_all(POLICY_LOSSES, "ratchet.algorithms.policy_losses_cov", {"clip_cov": "clip_cov", "kl_cov": "kl_cov"})


register_policy_loss = partial(decorator, POLICY_LOSSES)  # @register_policy_loss("name") on fn


# --------------------------------------------------------------------------- loss aggregation
# algorithm.loss_agg_mode; fn(loss [B, T], mask [B, T], Normaliser) -> scalar

LOSS_AGGREGATIONS: Registry[Callable] = Registry("loss aggregation")
register_all(
    LOSS_AGGREGATIONS,
    "ratchet.algorithms.aggregation",
    {
        "token-mean": "token_mean",
        "seq-mean-token-sum": "seq_mean_token_sum",
        "seq-mean-token-mean": "seq_mean_token_mean",
        "seq-mean-token-sum-norm": "seq_mean_token_sum_norm",
        "token-sum": "token_sum",
    },
)


register_loss_agg = partial(decorator, LOSS_AGGREGATIONS)  # @register_loss_agg("name") on fn


# --------------------------------------------------------------------------- KL estimators
# algorithm.kl.type; fn(logprob, ref_logprob) -> per-token KL. "k2" and "k3" are aliases; each
# name also has a straight-through "<name>+" variant: its value, the gradient of k2 (kl.py).

KL_ESTIMATORS: Registry[Callable] = Registry("KL estimator")
_KL_FUNCTIONS = {"k1": "kl_k1", "abs": "kl_abs", "mse": "kl_mse", "k2": "kl_mse", "low_var_kl": "kl_low_var", "k3": "kl_low_var"}
for _name, _fn in _KL_FUNCTIONS.items():
    KL_ESTIMATORS.register(_name, f"ratchet.algorithms.kl:{_fn}")
    KL_ESTIMATORS.register(_name + "+", f"ratchet.algorithms.kl:{_fn}_straight_through")


register_kl = partial(decorator, KL_ESTIMATORS)  # @register_kl("name") on fn


# --------------------------------------------------------------------------- off-policy corrections
# algorithm.off_policy.mode; fn(log_w [B, T], keep [B, T] bool, cap) -> off_policy.Decision

OFF_POLICY: Registry[Callable] = Registry("off-policy correction")
register_all(
    OFF_POLICY,
    "ratchet.algorithms.off_policy",
    {"none": "no_correction", "tis": "tis", "decoupled": "decoupled", "bypass": "bypass", "rejection": "rejection"},
)


register_off_policy = partial(decorator, OFF_POLICY)  # @register_off_policy("name") on fn


# --------------------------------------------------------------------------- preference losses
# stages[].loss of a `dpo` pipeline stage; fn(PrefInputs, PrefParams) -> PrefOutput (preference.py)


@dataclass(frozen=True)
class PreferenceLoss:
    """A preference loss and whether it needs the frozen reference model's log-probs."""

    impl: Callable | str
    needs_reference: bool = True

    @property
    def fn(self) -> Callable:
        return resolve(self.impl)


PREFERENCE_LOSSES: Registry[PreferenceLoss] = Registry("preference loss")
_PREF = "ratchet.algorithms.preference:"
PREFERENCE_LOSSES.register("sigmoid", PreferenceLoss(_PREF + "dpo_sigmoid"))
PREFERENCE_LOSSES.register("ipo", PreferenceLoss(_PREF + "ipo"))
PREFERENCE_LOSSES.register("simpo", PreferenceLoss(_PREF + "simpo", needs_reference=False))
