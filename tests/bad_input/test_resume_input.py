"""Bad input to submit and resume: ids that would escape the storage root, config changes a
resume would silently ignore, a resume of a run that is still running, and a checkpoint's
run state from an older ratchet."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from ratchet.config import ConfigError, RunConfig
from ratchet.config.resume_keys import check_resume_changes
from ratchet.ids import InvalidId
from ratchet.platform.client import RECIPE_PATH, RunIsLive, read_run_state
from ratchet.storage.checkpoint_store import CheckpointStore
from ratchet.storage.object_store import ObjectStore


@pytest.mark.parametrize("bad", ["../x", "../../etc", "a/b", ".hidden", "", "x" * 200])
def test_ids_are_refused_before_storage_or_temporal(offline_client, tmp_path, bad):
    with pytest.raises(InvalidId, match="invalid run id"):
        offline_client.submit("no-such-config.yaml", run_id=bad)  # the config is not even read
    with pytest.raises(InvalidId, match="invalid run id"):
        offline_client.resume(bad, root=str(tmp_path))
    with pytest.raises(InvalidId, match="invalid run id"):
        offline_client.get(bad)
    with pytest.raises(InvalidId, match="invalid checkpoint name"):
        offline_client.resume("fine-run", root=str(tmp_path), checkpoint=bad)
    assert list(tmp_path.iterdir()) == []


def test_cli_refuses_bad_ids_before_connecting(tmp_path):
    env = {**os.environ, "RATCHET_TEMPORAL_ADDRESS": "127.0.0.1:1"}
    cli = [sys.executable, "-m", "ratchet.platform.cli"]
    for args in (["checkpoints", "../../etc", "--root", str(tmp_path)], ["resume", "../x"], ["resume", "ok", "--checkpoint", "../x"]):
        out = subprocess.run([*cli, *args], capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 2, (args, out.stderr)
        assert "invalid run id" in out.stderr or "invalid checkpoint name" in out.stderr, out.stderr


def _config(**sections) -> dict:
    return RunConfig.model_validate({"model": {"path": "m"}, "data": {"train_files": "d.parquet"}, **sections}).model_dump(mode="json")


def test_resume_refuses_a_changed_model_path_naming_the_key_and_what_may_change():
    with pytest.raises(ConfigError) as err:
        check_resume_changes(_config(), _config(model={"path": "other"}, trainer={"lr": 1e-6}))
    assert [key for key, _ in err.value.issues] == ["model.path"]
    message = str(err.value)
    assert "stored 'm', asked 'other'" in message and "trainer.lr" in message and "Start a new run" in message


def test_resume_allows_optimizer_and_schedule_changes():
    changed = check_resume_changes(
        _config(),
        _config(
            trainer={"lr": 1e-6, "betas": [0.8, 0.9], "world_size": 2},
            loop={"steps": 99},
            checkpoint={"every": 1},
            algorithm={"kl": {"coef": 0.1}, "clip_ratio_high": 0.28},
        ),  # fmt: skip
    )
    assert changed == {
        "algorithm.clip_ratio_high": (0.2, 0.28), "algorithm.kl.coef": (0.0, 0.1), "checkpoint.every": (10, 1),
        "loop.steps": (20, 99), "trainer.betas": ([0.9, 0.99], [0.8, 0.9]), "trainer.lr": (1e-4, 1e-6), "trainer.world_size": (1, 2),
    }  # fmt: skip


def stored_batch_ref(index: int, part: int, key: str = "step") -> dict:
    """A BatchRef in a checkpoint's run state; older ratchets called its index `step`."""
    return {"run_id": "r", key: index, "uri": f"/runs/r/batches/step-{index:06d}/rollout.safetensors", "num_prompts": 2,
            "num_samples": 4, "num_response_tokens": 8, "policy_version": 36, "part": part, "prompt_start": 2 * index}  # fmt: skip


def test_run_state_of_an_old_checkpoint_still_loads():
    """Checkpoints written before the run state was bounded hold a list of every step's
    reward; those written before the batch index and the training step were named apart
    call a ready batch's index `step`."""
    rewards = [i / 100 for i in range(37)]
    score = {"reward_mean": 0.5, "reward_std": 0.1, "seconds": 1.0, "informative_groups": 2}
    ready = [[{"batch": stored_batch_ref(39, part), "score": score} for part in (0, 1)]]
    old = {"run": {"run_id": "r", "run_uri": "/runs/r", "config_id": "c"}, "next_step": 37, "policy_version": 37, "kl_coef": 0.01,
           "rewards": rewards, "eval_rewards": {"0": 0.1}, "next_batch": 40, "ready": ready}  # fmt: skip
    state = read_run_state(json.dumps(old).encode())
    assert (state.next_step, state.policy_version, state.kl_coef, state.next_batch) == (37, 37, 0.01, 40)
    assert state.reward_first10 == rewards[:10] and state.reward_last10 == rewards[-10:] and state.reward_count == 37
    assert state.latest_reward == rewards[-1] and state.eval_rewards == {"0": 0.1}
    (rounds,) = state.ready
    assert [(r.batch.index, r.batch.part, r.batch.prompt_start, r.score.reward_mean) for r in rounds] == [
        (39, 0, 78, 0.5),
        (39, 1, 78, 0.5),
    ]
    # A current one reads back as it was written.
    current = old | {"ready": [[{"batch": stored_batch_ref(39, part, key="index"), "score": score} for part in (0, 1)]]}
    assert read_run_state(json.dumps(current).encode()).ready == state.ready


FAST = ["warmup.steps=0", "data.eval_files=null", "loop.prompts_per_step=4", "rollout.n=2", "checkpoint.every=1",
        "checkpoint.keep_last=50", "resources.trainer_cpus=0.5"]  # fmt: skip


def _wait(predicate, what: str, limit_s: float = 300.0):
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.mark.integration
def test_resume_of_a_live_run_is_refused_and_hides_no_checkpoint(platform, tmp_path):
    """`Client.resume` on a run that is still open used to retire the checkpoints newer than
    the one asked for, then fail to start: the live run lost them. Now it is refused first;
    once the run has ended the same resume works, with a new KL coefficient applied."""
    client, root = platform.client, str(platform.runs_root)
    handle = client.submit(RECIPE_PATH, platform.overrides(*FAST, "loop.steps=500", "tracking.name=live"))
    checkpoints = CheckpointStore(ObjectStore(root).child(handle.run_id))
    _wait(lambda: len(checkpoints.list()) >= 2, "two checkpoints")
    handle.pause()
    _wait(lambda: handle.progress().phase == "paused", "the pause")
    before = [c.name for c in checkpoints.list()]

    with pytest.raises(RunIsLive, match=f"run '{handle.run_id}' is running"):
        client.resume(handle.run_id, root=root, checkpoint=before[0])
    assert set(before) <= {c.name for c in checkpoints.list()}, "a refused resume retired nothing"

    handle.cancel()
    _wait(lambda: not handle.running(), "the cancelled run to close")
    assert handle.status() == "CANCELED"

    other_model = tmp_path / "other-model"
    shutil.copytree(platform.assets.model, other_model)
    with pytest.raises(ConfigError, match="model.path: a resume cannot change it"):
        client.resume(handle.run_id, [f"model.path={other_model}"], root=root, checkpoint=before[0])

    # One more step from the first checkpoint, writing none (so the names after it stay retired).
    first = checkpoints.get(before[0])
    overrides = [f"loop.steps={first.step + 1}", "algorithm.kl.coef=0.05", "checkpoint.every=0"]
    summary = client.resume(handle.run_id, overrides, root=root, checkpoint=before[0]).result(timeout=600)
    assert summary.steps == first.step + 1
    kl = ObjectStore(summary.run_uri).get_json(f"train_log/v{first.step:08d}.json")["kl_coef"]
    assert kl == 0.05, "the resumed step trained with the new coefficient, not the checkpoint's 0.001"
    assert [c.name for c in checkpoints.list()] == [before[0]], "the newer checkpoints were retired once the resume started"
