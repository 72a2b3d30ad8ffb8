"""Kill anything, lose nothing, in sync mode: faults injected at seeded random moments
while a PPO run trains (tests/e2e/chaos_platform.py: the worker process, the trainer,
rollout and critic actors, the Temporal server, the Ray head).

Each run must finish by itself with every step recorded once and every prompt trained on
once, and (deterministic mode) with final weights equal to an uninterrupted run's bit for
bit. The fully_async runs are in test_chaos_async.py: a module each, so that the two run
side by side on the suite's two test processes.
"""

from __future__ import annotations

import json
import re

import pytest

from ratchet.platform.client import RECIPE_PATH

from .chaos_platform import FAULTS, await_result, check_exactly_once, run_with_faults
from .run_checks import assert_same_weights, metric_lines

pytestmark = pytest.mark.integration


def test_sync_ppo_run_survives_every_fault_with_identical_weights(chaos):
    """PPO with GAE, so that the critic is one more thing to lose: its state is in every
    checkpoint, and a critic killed mid-run is rebuilt from one plus a replay of its logged
    updates, like the trainer. Six faults, one of each kind; the weights then match an
    uninterrupted run's bit for bit. (One run for the critic and the rest: the faults do
    not interfere, and a second pair of runs would double this module's cost.)"""
    extra = ["algorithm.adv_estimator=gae", "algorithm.gamma=1.0", "algorithm.lam=0.95"]
    clean = await_result(chaos, chaos.client.submit(RECIPE_PATH, chaos.overrides(*extra, "tracking.name=clean")))
    summary, run_dir, fired = run_with_faults(chaos, "chaos-sync", extra, seed=1, kinds=(*FAULTS, "critic"))
    assert len(fired) == 6, fired
    check_exactly_once(summary, run_dir)
    assert_same_weights(clean, summary, fired)
    # The critic's numbers are in every step's metrics (what a PPO run's reader looks at).
    assert all({"vf_loss", "values_mean", "returns_mean"} <= m.keys() for m in metric_lines(run_dir))
    # Retention kept the last two checkpoints (steps 8 and 12), each committed, each with
    # the critic's state.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000008", "step-00000012"]
    manifest = json.loads((run_dir / "checkpoints" / "step-00000008" / "MANIFEST.json").read_text())
    assert {"critic/critic.safetensors", "critic/critic.json"} <= set(manifest["files"])
    # The critic was rebuilt from a checkpoint (or from the initial critic, before the first one).
    log = (chaos.state / "logs" / "worker.log").read_text()
    assert re.search(rf"run {summary.run_id}: critic rebuilt at v\d+ from (checkpoint step-\d+|the initial critic) and \d+ replayed", log), log[-3000:]
