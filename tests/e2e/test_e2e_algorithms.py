"""The algorithm cases whose flags the workflow acts on run a few steps through the real
workflow (Temporal + Ray), combined into three runs: tests/algorithm_cases.py says which
and why; every case runs in-process in tests/unit/test_algorithm_steps.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ratchet.models.tiny import build_tiny_reward_model
from ratchet.platform.client import RECIPE_PATH
from tests.algorithm_cases import FAST, REWARD_MODEL_RUN, STEPS, WORKFLOW_RUNS, combined

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("run", WORKFLOW_RUNS)
def test_algorithm_runs_through_the_workflow(platform, run, tmp_path):
    names = WORKFLOW_RUNS[run]
    overrides, expected_metrics = combined(names)
    mixes_reward_model = run == REWARD_MODEL_RUN
    if mixes_reward_model:
        overrides = [*overrides, f"reward.model_path={build_tiny_reward_model(tmp_path / 'rm')}", "reward.model_weight=0.5"]
    handle = platform.client.submit(RECIPE_PATH, platform.overrides(*FAST, *overrides, f"tracking.name={run.replace('_', '-')}"))
    summary = handle.result(timeout=600)
    assert summary.steps == STEPS and summary.policy_version == STEPS
    lines = [json.loads(x) for x in (Path(summary.run_uri) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(STEPS))
    for r in lines:
        assert expected_metrics <= r.keys(), expected_metrics - r.keys()
        assert all(v == v for v in r.values()), "NaN in metrics"  # NaN != NaN
    if "adaptive_kl" in names:
        assert lines[-1]["kl_coef"] != lines[0]["kl_coef"], "the adaptive controller never moved the coefficient"
    if mixes_reward_model:
        from ratchet.storage.batch_store import BatchStore
        from ratchet.storage.object_store import ObjectStore
        from ratchet.workers.batch import load_scores

        rewards, extras = load_scores(BatchStore(ObjectStore(summary.run_uri)), 0)
        for total, e in zip(rewards.tolist(), extras):
            assert {"rule_score", "rm_score"} <= e.keys()
            assert total == pytest.approx(e["rule_score"] + 0.5 * e["rm_score"], abs=1e-5)
