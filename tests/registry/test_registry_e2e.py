"""A real run on the real platform (Temporal dev server, Ray, the `ratchet worker` process
that `ratchet demo` starts) lands in the registry of the platform's state folder: the
worker gets RATCHET_REGISTRY_URL from `start_worker_process`."""

from __future__ import annotations

import pytest

from ratchet.platform.client import RECIPE_PATH
from ratchet.registry.db import Registry
from ratchet.registry.urls import sqlite_url
from ratchet.storage.checkpoint_store import CheckpointStore
from ratchet.storage.object_store import ObjectStore

pytestmark = pytest.mark.integration

TINY = ["warmup.steps=2", "data.eval_files=null", "loop.prompts_per_step=4", "rollout.n=4", "loop.steps=3",
        "checkpoint.every=2", "resources.trainer_cpus=0.5", "tracking.name=registry", "tracking.experiment=registry-e2e",
        "tracking.mlflow=false"]  # fmt: skip


def test_a_real_run_lands_in_the_registry(platform, monkeypatch):
    monkeypatch.delenv("RATCHET_REGISTRY_URL", raising=False)
    summary = platform.client.submit(RECIPE_PATH, platform.overrides(*TINY)).result(timeout=600)
    reg = Registry.open(sqlite_url(platform.settings.state_dir))
    try:
        r = reg.run(summary.run_id)
        assert r is not None, [x.run_id for x in reg.runs()]
        assert (r.status, r.experiment, r.name, r.algorithm, r.loop_mode) == ("completed", "registry-e2e", "registry", "grpo", "sync")
        assert r.last_step == summary.steps - 1 == 2
        assert r.last_reward == pytest.approx(summary.reward_last10, abs=1.0)  # a mean of the steps' rewards
        assert r.final_metrics["steps"] == 3.0 and 0.0 <= r.final_metrics["reward_mean"] <= 1.0
        assert (r.parent_run_id, r.sweep_id) == (None, None)
        stored = CheckpointStore(ObjectStore(summary.run_uri)).list()
        assert [(c.name, c.step, c.uri) for c in reg.checkpoints(summary.run_id)] == [(c.name, c.step, c.uri) for c in stored]
        assert 2 in [c.step for c in stored]  # checkpoint.every=2 of 3 steps
    finally:
        reg.close()
