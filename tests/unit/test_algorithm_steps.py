"""Every algorithm case takes its RL steps in-process: `LocalLoop` calls the engine, the
reward scoring and `PolicyTrainer.train_step` (with the critic for gae) exactly as the Ray
workers do, so each registered name is exercised in about a second instead of a platform
run. The cases whose flags the workflow acts on also run through it
(tests/e2e/test_e2e_algorithms.py)."""

from __future__ import annotations

import math

import pytest

from ratchet.platform.client import RECIPE_PATH
from tests.algorithm_cases import ALIASES, CASES, FAST, STEPS, WORKFLOW_CASES, WORKFLOW_RUNS, combined

# Metrics only the workflow records (the dynamic-sampling rounds it ran); the local loop
# samples one round per step.
WORKFLOW_METRICS = {"rollout_rounds"}


def _config(assets, tmp_path, overrides):
    from ratchet.config import load_config

    train, _ = assets.data["copy"]
    paths = [f"model.path={assets.model}", f"data.train_files={train}", f"storage.root={tmp_path}"]
    return load_config(RECIPE_PATH, [*FAST, *overrides, *paths], check_files=False)


def test_every_registered_algorithm_has_a_case():
    """A new estimator, loss, aggregation or correction must be added to CASES (or to a
    combined case there): this fails for one that no case runs."""
    from ratchet.algorithms import ADV_ESTIMATORS, LOSS_AGGREGATIONS, OFF_POLICY, POLICY_LOSSES
    from ratchet.config import load_config

    keys = {"adv_estimator": ADV_ESTIMATORS, "policy_loss": POLICY_LOSSES, "loss_agg_mode": LOSS_AGGREGATIONS}
    used: dict[str, set[str]] = {k: set() for k in [*keys, "off_policy"]}
    for overrides, _ in CASES.values():
        alg = load_config(RECIPE_PATH, [*FAST, *overrides], check_files=False).algorithm
        for key in keys:
            used[key].add(getattr(alg, key))
        used["off_policy"].add(alg.off_policy.mode)
    missing = {
        key: sorted(set(registry.names()) - used[key] - {a for a, b in ALIASES.items() if b in used[key]})
        for key, registry in [*keys.items(), ("off_policy", OFF_POLICY)]
    }
    assert not any(missing.values()), f"no algorithm case runs {missing}"
    assert set(WORKFLOW_CASES) <= CASES.keys()
    # Every workflow case goes through the platform in one of its runs, with flags that combine.
    assert sorted(n for names in WORKFLOW_RUNS.values() for n in names) == sorted(WORKFLOW_CASES)
    for names in WORKFLOW_RUNS.values():
        load_config(RECIPE_PATH, [*FAST, *combined(names)[0]], check_files=False)


@pytest.mark.parametrize("name", sorted(CASES))
def test_algorithm_steps_in_process(assets, tmp_path, name):
    import torch

    from ratchet.workers.local_loop import LocalLoop

    overrides, expected_metrics = CASES[name]
    cfg = _config(assets, tmp_path, overrides)
    loop = LocalLoop(cfg)
    before = {k: v.clone() for k, v in loop.trainer.model.state_dict().items()}
    steps = [loop.step(s) for s in range(STEPS)]
    assert loop.trainer.version == STEPS
    for metrics in steps:
        assert expected_metrics - WORKFLOW_METRICS <= metrics.keys(), expected_metrics - metrics.keys()
        assert all(math.isfinite(v) for v in metrics.values()), {k: v for k, v in metrics.items() if not math.isfinite(v)}
    after = loop.trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "no weight moved in two updates"
    if cfg.algorithm.kl.target is not None:  # an adaptive controller moves the coefficient it starts from
        assert loop.kl_coef != cfg.algorithm.kl.coef
