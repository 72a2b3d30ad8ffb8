"""Safe-RLHF and a rollout filter through the real workflow (Temporal + Ray): the cost
and the filter's verdicts are stored with the batch, the Lagrange multiplier is in the
metrics, moves, and is carried by the workflow from step to step (each update's train
log holds the one it got) and into the checkpoint's run state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ratchet.platform.client import RECIPE_PATH
from ratchet.storage.batch_store import BatchStore
from ratchet.storage.object_store import ObjectStore
from ratchet.workers.batch import load_step

pytestmark = pytest.mark.integration

STEPS = 3
FAST = ["warmup.steps=2", "data.eval_files=null", f"loop.steps={STEPS}", "loop.prompts_per_step=8", "rollout.n=4"]
SAFE = [
    "safety.cost_function=ratchet.tasks.costs:compute_cost",
    "safety.budget=0.0",  # any 7 in a step's batch is over budget: lambda only rises
    "safety.lambda_init=0.5",
    "safety.lambda_lr=1.0",
    "rollout.filter=ratchet.tasks.filters:drop_forbidden",
    f"checkpoint.every={STEPS}",
]


def test_safe_rlhf_and_filter_through_the_workflow(platform):
    handle = platform.client.submit(RECIPE_PATH, platform.overrides(*FAST, *SAFE, "tracking.name=safe-rlhf"))
    summary = handle.result(timeout=600)
    assert summary.steps == STEPS
    run_dir = Path(summary.run_uri)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(STEPS))
    store = ObjectStore(summary.run_uri)
    lam = 0.5
    for step, r in enumerate(lines):
        data = load_step(BatchStore(store), step)
        costs, keep = data.costs, data.keep
        assert costs is not None and keep is not None and len(costs) == 32
        # the stored verdicts are the filter's: a response with a 7 costs 1 and is dropped
        assert keep.tolist() == (costs == 0).tolist()
        assert r["rollout_filter/dropped"] == float((~keep).sum())
        assert r["safe/cost_mean"] == pytest.approx(float(costs.mean()))
        # this update got the multiplier the previous one returned (carried by the workflow)
        assert store.get_json(f"train_log/v{step:08d}.json")["safe_lambda"] == pytest.approx(lam)
        lam = lam + 1.0 * r["safe/cost_mean"]
        assert r["safe/lambda"] == pytest.approx(lam)
    assert lines[-1]["safe/lambda"] > lines[0]["safe/lambda"], "the multiplier never moved"
    state = json.loads((run_dir / "checkpoints" / f"step-{STEPS:08d}" / "run_state.json").read_text())
    assert state["safe_lambda"] == pytest.approx(lines[-1]["safe/lambda"])
