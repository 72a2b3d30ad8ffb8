"""Safe-RLHF learns its constraint: on the copy task a cost of 1 marks any response that
writes the digit 7 (src/ratchet/tasks/costs.py), and the Lagrange multiplier holds the
batch's mean cost under a budget of 0.1 while the reward still rises. It uses the
in-process loop (workers/local_loop.py: the trainer code the Ray workers run), from a
warm-up model; about 15 s on one core. Without the multiplier (lambda fixed at 0, run by
hand on seeds 0-3) the cost stays at 0.25-0.38 over the last 5 of 30 steps."""

from __future__ import annotations

import pytest
import torch

from ratchet.config import load_config
from ratchet.storage.object_store import ObjectStore
from ratchet.workers.local_loop import LocalLoop
from ratchet.workers.warmup import warmup_policy

from .test_safe_rlhf_and_filters import EXAMPLE

torch.set_num_threads(1)

STEPS = 30
# safe-rlhf's log-parameterised multiplier: it decays slowly once the cost is under budget
# (the projected one drops to 0 within ~10 steps, and the cost creeps back to the budget).
SAFE = ["safety.budget=0.1", "safety.lambda_lr=3.0", "safety.lambda_init=1.0", "safety.lambda_update=log"]


@pytest.fixture(scope="module")
def base(assets, tmp_path_factory):
    train, _ = assets.data["copy"]
    root = tmp_path_factory.mktemp("safe")
    overrides = [f"model.path={assets.model}", f"data.train_files={train}", "data.eval_files=null", f"storage.root={root}"]
    cfg = load_config(EXAMPLE, overrides)
    warm = warmup_policy(cfg, cfg.model.path, ObjectStore(str(root / "warm")).url).uri
    return overrides, warm


def run(base, extra: list[str], steps: int) -> list[dict[str, float]]:
    overrides, warm = base
    loop = LocalLoop(load_config(EXAMPLE, [*overrides, *extra]), policy_path=warm)
    return [loop.step(s) for s in range(steps)]


def mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


@pytest.mark.slow
def test_cost_goes_under_the_budget_while_reward_rises(base):
    safe = run(base, SAFE, STEPS)
    # the multiplier: up while the first batches break the budget, and carried step to step
    assert safe[0]["safe/cost_mean"] > 0.1 and safe[0]["safe/lambda"] > 1.0
    assert all(r["safe/lambda"] > 0 for r in safe) and len({round(r["safe/lambda"], 6) for r in safe}) == STEPS
    # The spread over seeds 0-7, each with its own warm-up (benchmarks/learning_spread.py
    # safe-rlhf; AMD EPYC, torch 2.13 CPU): cost 0.19-0.40 at step 0 and 0.016-0.069 over
    # the last 5 steps, 0.04-0.37 of step 0's; the multiplier 1.3-2.45 at most (never at
    # lambda_max 10, so every step's differs); budget violation over the last 10 steps
    # 0-0.003; reward up by 0.032-0.094 from the first 5 steps to the last 5. The cost's
    # mean over the first 5 steps is no yardstick: the multiplier brings it down within
    # them (last 5 over first 5: 0.14-0.96).
    safe_cost = mean(safe[-5:], "safe/cost_mean")
    assert safe_cost < 0.1 < safe[0]["safe/cost_mean"], safe_cost
    assert safe_cost < 0.5 * safe[0]["safe/cost_mean"], safe_cost
    assert mean(safe[-10:], "safe/cost_budget_violation") < 0.02
    assert mean(safe[-5:], "reward_mean") > mean(safe[:5], "reward_mean") + 0.01


def test_rollout_filter_in_the_loop(base):
    rows = run(base, ["safety.cost_function=null", "rollout.filter=ratchet.tasks.filters:drop_forbidden"], 3)
    for r in rows:
        assert 0 < r["rollout_filter/dropped"] < 128  # 16 prompts x 8 samples
        assert r["kept_fraction"] == pytest.approx(1 - r["rollout_filter/dropped"] / 128)
        assert not any(k.startswith("safe/") for k in r)
