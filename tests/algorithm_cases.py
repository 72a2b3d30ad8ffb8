"""The algorithm matrix: every registered estimator, policy loss, loss aggregation and
off-policy correction, combined into 13 mixes that each take a few RL steps.

All 13 run in-process (tests/unit/test_algorithm_steps.py: `LocalLoop`, the very pieces the
Ray workers call, about a second each); `WORKFLOW_CASES` names the few whose flags the
workflow itself acts on, which also run through Temporal and Ray
(tests/e2e/test_e2e_algorithms.py).
"""

from __future__ import annotations

STEPS = 2
FAST = ["warmup.steps=0", "data.eval_files=null", f"loop.steps={STEPS}", "loop.prompts_per_step=8", "rollout.n=4"]

CASES = {
    "ppo_gae_reinforce_is_bypass": (
        [
            "algorithm.adv_estimator=gae",
            "algorithm.gamma=1.0",
            "algorithm.lam=0.95",
            "critic.warmup_steps=1",
            "algorithm.policy_loss=reinforce_is",
            "algorithm.off_policy.mode=bypass",
            "algorithm.loss_agg_mode=seq-mean-token-sum",
        ],  # fmt: skip
        {"vf_loss", "values_mean", "returns_mean"},
    ),
    "rloo_dual_clip": (["algorithm.adv_estimator=rloo", "algorithm.policy_loss=dual_clip"], set()),
    "reinforce_plus_plus_kl_cov": (
        [
            "algorithm.adv_estimator=reinforce_plus_plus",
            "algorithm.kl.in_reward=true",
            "algorithm.policy_loss=kl_cov",
            "algorithm.kl_cov_ratio=0.02",
        ],
        {"kl_in_reward"},
    ),
    "opo_token_sum_decoupled": (
        [
            "algorithm.adv_estimator=opo",
            "algorithm.loss_agg_mode=token-sum",
            "algorithm.off_policy.mode=decoupled",
            "algorithm.off_policy.cap=2.0",
        ],
        {"off_policy/is_weight_mean", "off_policy/is_weight_max"},
    ),
    "remax_cispo": (
        ["algorithm.adv_estimator=remax", "algorithm.policy_loss=cispo", "algorithm.loss_agg_mode=seq-mean-token-sum-norm"],
        set(),
    ),
    "dapo": (
        [
            "algorithm.dynamic_sampling=true",
            "algorithm.clip_ratio_high=0.28",
            "algorithm.overlong.buffer_len=2",
            "algorithm.loss_agg_mode=token-mean",
        ],
        {"kept_fraction", "rollout_rounds"},
    ),
    "grpo_passk_gspo": (
        [
            "algorithm.adv_estimator=grpo_passk",
            "algorithm.policy_loss=gspo",
            "algorithm.clip_ratio_low=0.0003",
            "algorithm.clip_ratio_high=0.0004",
            "algorithm.loss_agg_mode=seq-mean-token-mean",
        ],
        set(),
    ),
    "adaptive_kl": (
        [
            "algorithm.kl.coef=0.05",
            "algorithm.kl.target=0.01",
            "algorithm.kl.horizon=100",
            "algorithm.adv_estimator=reinforce_plus_plus_baseline",
            "algorithm.off_policy.mode=tis",
            "algorithm.policy_loss=dppo_kl",
        ],  # fmt: skip
        {"kl_coef", "off_policy/frac_truncated"},
    ),
    # verl's wider catalogue: each run combines a new estimator, a new loss and a new
    # correction, so every registered name runs in these 13 cases. Two PPO epochs
    # where the loss differs from REINFORCE only once the ratio leaves 1.
    "otb_sapo": (
        [
            "algorithm.adv_estimator=optimal_token_baseline",
            "algorithm.policy_loss=sapo",
            "algorithm.loss_agg_mode=seq-mean-token-mean",
            "trainer.ppo_epochs=2",
        ],
        set(),
    ),
    "gpg_dppo_tv_rejection_and_is": (
        [
            "algorithm.adv_estimator=gpg",
            "algorithm.policy_loss=dppo_tv",
            "trainer.ppo_epochs=2",
            "algorithm.off_policy.mode=rejection",
            "algorithm.off_policy.level=geometric",
            "algorithm.off_policy.cap=1.5",
            "algorithm.off_policy.is_weights={low: 0.8, high: 1.5}",
            "algorithm.off_policy.rejection=[{statistic: k2, level: token, high: 2.0}]",
        ],
        {"off_policy/frac_truncated", "off_policy/rs_k2_token_frac_masked"},
    ),
    "gmpo_icepop_k3_rejection": (
        [
            "loop.mode=one_step_off",
            "algorithm.policy_loss=gmpo",
            "algorithm.clip_ratio_low=0.4",
            "algorithm.clip_ratio_high=0.4",
            "algorithm.loss_agg_mode=seq-mean-token-mean",
            "algorithm.off_policy.is_weights={kind: icepop, low: 0.5, high: 5.0}",
            "algorithm.off_policy.rejection=[{statistic: k3, level: seq_mean, high: 0.1}, {statistic: ratio, level: token, low: 0.2, high: 10.0}]",
        ],  # fmt: skip
        {
            "off_policy/ppo_kl",
            "off_policy/chi2_token",
            "off_policy/chi2_seq",
            "off_policy/ess",
            "off_policy/training_ppl",
            "off_policy/rollout_ppl",
            "off_policy/frac_zeroed",
            "off_policy/rs_k3_seq_mean_frac_masked",
            "off_policy/rs_ratio_token_frac_masked",
        },  # fmt: skip
    ),
    "dro_sequence_is_batch_normalised": (
        [
            "loop.mode=one_step_off",
            "algorithm.policy_loss=dro",
            "trainer.ppo_epochs=2",
            "algorithm.off_policy.is_weights={level: sequence, low: 0.5, high: 2.0, batch_normalize: true}",
            "algorithm.off_policy.rejection=[{statistic: k3, level: seq_sum, high: 1.0}]",
        ],  # fmt: skip
        {"off_policy/batch_norm_factor", "off_policy/rs_k3_seq_sum_frac_masked"},
    ),
    "clip_cov_decoupled_two_criteria": (
        [
            "loop.mode=one_step_off",
            "algorithm.policy_loss=clip_cov",
            "algorithm.clip_cov_ratio=0.02",
            "algorithm.off_policy.mode=decoupled",
            "algorithm.off_policy.rejection=[{statistic: ratio, level: token, low: 0.5, high: 4.0}, {statistic: k2, level: seq_max, high: 1.0}]",
        ],  # fmt: skip
        {"off_policy/rs_ratio_token_frac_masked", "off_policy/rs_k2_seq_max_frac_masked"},
    ),
}


# Another name for an algorithm above: the same function, so the same case covers it.
ALIASES = {"tir_optimal_token_baseline": "optimal_token_baseline", "geo_mean": "gmpo"}

# The cases whose flags the workflow and its activities act on, beyond the trainer's loss:
# greedy baseline parts generated and scored (remax), refill rounds (dynamic sampling), the
# KL coefficient carried in the workflow's state from step to step (an adaptive
# controller), and rollouts one version behind (loop.mode=one_step_off). The other cases
# differ only inside `train_step`, which the in-process matrix runs exactly as the trainer
# actor does. The critic (gae) goes through the workflow in tests/e2e/test_chaos_sync.py,
# a PPO run whose critic is killed and rebuilt (its metrics checked there).
WORKFLOW_CASES = ("remax_cispo", "dapo", "adaptive_kl", "gmpo_icepop_k3_rejection")

# How the platform runs them: each run combines cases whose flags do not overlap (a run
# costs about 20 s of actor start-up on 2 cores, its steps well under one), and
# REWARD_MODEL_RUN also mixes a reward model into the rule reward (the reward worker's
# other input), which then scores remax's greedy baselines too.
WORKFLOW_RUNS = {
    "dapo_adaptive_kl": ("dapo", "adaptive_kl"),
    "remax_cispo_reward_model": ("remax_cispo",),
    "gmpo_icepop_k3_rejection": ("gmpo_icepop_k3_rejection",),
}
REWARD_MODEL_RUN = "remax_cispo_reward_model"


def combined(names: tuple[str, ...]) -> tuple[list[str], set[str]]:
    """The overrides and expected metrics of `names` run as one; their keys must not overlap."""
    overrides: list[str] = []
    metrics: set[str] = set()
    for name in names:
        case_overrides, case_metrics = CASES[name]
        keys = {o.split("=", 1)[0] for o in overrides}
        clash = keys & {o.split("=", 1)[0] for o in case_overrides}
        assert not clash, f"cases {names} both set {sorted(clash)}"
        overrides += case_overrides
        metrics |= case_metrics
    return overrides, metrics
