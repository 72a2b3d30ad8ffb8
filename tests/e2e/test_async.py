"""The asynchronous loop modes through the real workflow, Ray and torch: bounded staleness
measured on the tokens themselves, every prompt exactly once, and pause / resume / stop
through the client.

The scheduling of every mode (ordering, staleness and queue bounds, pause and stop in
each mode, one_step_off's overlap) is covered in seconds by tests/integration/test_loop_modes.py with
stand-in activities; what stays here is what stand-ins cannot show: the version of each
generated token, the trainer's staleness histogram, and a real export after a stop."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from ratchet.platform.client import RECIPE_PATH
from ratchet.storage.batch_store import BatchStore
from ratchet.storage.object_store import ObjectStore
from ratchet.workers.batch import RolloutBatch
from .run_checks import first_prompts
from ..polling import wait_until

pytestmark = pytest.mark.integration

PROMPTS, N = 4, 4
FAST = ["warmup.steps=2", "data.eval_files=null", f"loop.prompts_per_step={PROMPTS}", f"rollout.n={N}"]
MODES = {
    "fully_async": ["loop.mode=fully_async", "loop.max_staleness=1", "loop.queue_limit=2", "algorithm.off_policy.mode=tis"],
    "fully_async_stale2": ["loop.mode=fully_async", "loop.max_staleness=2", "loop.queue_limit=3", "loop.sync_every=2"],
    # Whole rollouts: the sync waits for the generation in flight (the rollout lock).
    "fully_async_whole": ["loop.mode=fully_async", "rollout.partial_rollout=false", "algorithm.off_policy.mode=decoupled"],
}


def metrics_of(summary) -> list[dict]:
    return [json.loads(x) for x in (Path(summary.run_uri) / "metrics.jsonl").read_text().splitlines()]


def pause_resume_stop(handle) -> int:
    """Pause the run once it trains, check that it holds still, resume it, stop it two steps
    later; the step it was paused at."""
    wait_until(lambda: handle.progress().step >= 2)
    handle.pause()
    paused_at = wait_until(lambda: (p := handle.progress()).phase == "paused" and p.step)
    time.sleep(3.0)
    assert handle.progress().step == paused_at, "a paused run must not advance"
    assert handle.progress().paused
    handle.resume()
    wait_until(lambda: handle.progress().step >= paused_at + 2)
    handle.stop()
    return paused_at


@pytest.mark.parametrize("mode", sorted(MODES))
def test_staleness_bound_and_prompts_exactly_once(platform, mode):
    """The fully_async run (partial rollouts) is also paused, resumed and stopped through
    the client, and its numbers checked over the steps it trained: a run of its own for the
    steering cost a run's actor starts and showed nothing these checks do not."""
    steered = mode == "fully_async"
    steps = 200 if steered else 6
    max_staleness = 2 if mode.endswith("stale2") else 1
    handle = platform.client.submit(
        RECIPE_PATH, platform.overrides(*FAST, *MODES[mode], f"loop.steps={steps}", f"tracking.name={mode.replace('_', '-')}")
    )
    if steered:
        paused_at = pause_resume_stop(handle)
    summary = handle.result(timeout=600)
    if steered:
        assert summary.stopped and paused_at + 2 <= summary.steps < steps
        assert summary.final_policy_uri, "a stopped run still exports its policy"
        steps = summary.steps
    assert summary.steps == steps and summary.policy_version == steps
    lines = metrics_of(summary)
    assert [r["step"] for r in lines] == list(range(steps))
    store = BatchStore(ObjectStore(summary.run_uri))
    trained_prompts = []
    for r in lines:
        # From the recorded versions: the policy trained (version before the update) minus
        # the version that generated the batch.
        lag = (r["policy_version"] - 1) - r["batch_policy_version"]
        assert 0 <= lag <= max_staleness, r
        assert lag == r["staleness"]
        batch = RolloutBatch.load(store, int(r["batch_index"]))
        versions = batch.policy_version[batch.response_mask > 0]
        # The batch's version is its oldest token's; with partial rollouts later tokens may
        # come from newer weights, never from weights newer than the ones trained.
        assert versions.min().item() == r["batch_policy_version"]
        if mode.startswith("fully_async") and mode != "fully_async_whole":
            assert versions.max().item() <= r["policy_version"] - 1
        else:
            assert (versions == r["batch_policy_version"]).all()
        # The trainer's per-token histogram agrees, and sums to one.
        hist = {int(k.rpartition("/")[2]): v for k, v in r.items() if k.startswith("staleness_tokens/") and k[-1].isdigit()}
        assert max(hist) == r["staleness_tokens/max"] <= max_staleness
        assert abs(sum(hist.values()) - 1.0) < 1e-6
        trained_prompts += torch.unique(batch.prompt_index).tolist()
    assert sorted(trained_prompts) == sorted(first_prompts(Path(summary.run_uri), steps * PROMPTS)), "every prompt trained on exactly once"
    # The producer starts a batch only if it will be fresh enough when trained (counting the
    # batch being trained): in steady state nothing is generated just to be dropped.
    assert summary.dropped_samples == 0
