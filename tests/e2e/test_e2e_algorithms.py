"""Each algorithm family runs a few steps through the real workflow (Temporal + Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ratchet.models.tiny import build_tiny_reward_model
from ratchet.platform.client import RECIPE_PATH

pytestmark = pytest.mark.integration

STEPS = 3
FAST = ["warmup.steps=2", "data.eval_files=null", f"loop.steps={STEPS}", "loop.prompts_per_step=8", "rollout.n=4"]

CASES = {
    "ppo_gae": (["algorithm.adv_estimator=gae", "algorithm.gamma=1.0", "algorithm.lam=0.95"], {"vf_loss", "values_mean", "returns_mean"}),
    "rloo": (["algorithm.adv_estimator=rloo"], set()),
    "reinforce_plus_plus": (["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.kl.in_reward=true"], {"kl_in_reward"}),
    "grpo_decoupled": (
        ["algorithm.off_policy.mode=decoupled", "algorithm.off_policy.cap=2.0"],
        {"off_policy/is_weight_mean", "off_policy/is_weight_max"},
    ),
    "remax": (["algorithm.adv_estimator=remax"], set()),
    "dapo": (
        ["algorithm.dynamic_sampling=true", "algorithm.clip_ratio_high=0.28", "algorithm.overlong.buffer_len=2", "algorithm.loss_agg_mode=token-mean"],
        {"kept_fraction", "rollout_rounds"},
    ),
    "gspo": (["algorithm.policy_loss=gspo", "algorithm.clip_ratio_low=0.0003", "algorithm.clip_ratio_high=0.0004", "algorithm.loss_agg_mode=seq-mean-token-mean"], set()),
    "adaptive_kl": (["algorithm.kl.coef=0.05", "algorithm.kl.target=0.01", "algorithm.kl.horizon=100"], {"kl_coef"}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_algorithm_runs_through_the_workflow(platform, name):
    overrides, expected_metrics = CASES[name]
    handle = platform.client.submit(RECIPE_PATH, platform.overrides(*FAST, *overrides, f"tracking.name={name.replace('_', '-')}"))
    summary = handle.result(timeout=600)
    assert summary.steps == STEPS and summary.policy_version == STEPS
    lines = [json.loads(x) for x in (Path(summary.run_uri) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(STEPS))
    for r in lines:
        assert expected_metrics <= r.keys(), expected_metrics - r.keys()
        assert all(v == v for v in r.values()), "NaN in metrics"  # NaN != NaN
    if name == "adaptive_kl":
        assert lines[-1]["kl_coef"] != lines[0]["kl_coef"], "the adaptive controller never moved the coefficient"


def test_reward_model_mixes_with_rule_reward(platform, tmp_path):
    rm = build_tiny_reward_model(tmp_path / "rm")
    handle = platform.client.submit(
        RECIPE_PATH,
        platform.overrides(*FAST, f"reward.model_path={rm}", "reward.model_weight=0.5", "tracking.name=rm-mix"),
    )
    summary = handle.result(timeout=600)
    assert summary.steps == STEPS
    from ratchet.storage import BatchStore, ObjectStore
    from ratchet.workers.batch import load_scores

    rewards, extras = load_scores(BatchStore(ObjectStore(summary.run_uri)), 0)
    for total, e in zip(rewards.tolist(), extras):
        assert {"rule_score", "rm_score"} <= e.keys()
        assert total == pytest.approx(e["rule_score"] + 0.5 * e["rm_score"], abs=1e-5)
