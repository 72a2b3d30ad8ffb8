"""`ratchet resume`: a finished or stopped run continues from its checkpoint, also with
another trainer world size (1 -> 2 ranks and back), through the real workflow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from ratchet.platform.client import RECIPE_PATH
from ratchet.storage.checkpoint_store import CheckpointStore
from ratchet.storage.object_store import ObjectStore

pytestmark = pytest.mark.integration

FAST = ["warmup.steps=2", "data.eval_files=null", "loop.prompts_per_step=4", "rollout.n=4", "checkpoint.every=3",
        "checkpoint.keep_last=5", "resources.trainer_cpus=0.5"]  # fmt: skip


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_from_checkpoint_with_other_world_sizes(platform):
    client = platform.client
    first = client.submit(RECIPE_PATH, platform.overrides(*FAST, "loop.steps=3", "tracking.name=resume")).result(timeout=600)
    run_dir = Path(first.run_uri)
    checkpoints = CheckpointStore(ObjectStore(first.run_uri))
    assert [c.name for c in checkpoints.list()] == ["step-00000003"]
    assert checkpoints.get("step-00000003").meta == {"step": 3, "policy_version": 3, "world_size": 1}

    # 1 -> 2 ranks: three more steps from the step-3 checkpoint.
    second = client.resume(first.run_id, ["trainer.world_size=2", "loop.steps=6"], root=str(platform.runs_root)).result(timeout=600)
    assert second.steps == 6 and second.policy_version == 6
    info = checkpoints.get("step-00000006")
    assert info.meta["world_size"] == 2
    # The sharded trainer state of both ranks is in it, and an HF export of the policy.
    assert sum(1 for f in info.files if f.startswith("trainer/") and f.endswith(".safetensors")) == 2
    assert {"hf/config.json", "hf/model.safetensors", "run_state.json"} <= set(info.files)

    # 2 -> 1 rank, from the step-6 checkpoint.
    third = client.resume(first.run_id, ["trainer.world_size=1", "loop.steps=8"], root=str(platform.runs_root)).result(timeout=600)
    assert third.steps == 8 and third.policy_version == 8
    assert [m["step"] for m in metrics(run_dir)] == list(range(8)), "each step's metrics exactly once"
    # Prompts continue where the checkpoint left them: the train log names batches in order.
    store = ObjectStore(first.run_uri)
    batches = [store.get_json(f"train_log/v{v:08d}.json")["batch"] for v in range(8)]
    assert batches == list(range(8))
    weights = load_file(str(Path(third.final_policy_uri) / "model.safetensors"))
    exported = load_file(str(run_dir / "checkpoints" / "step-00000006" / "hf" / "model.safetensors"))
    assert any((weights[k] != exported[k]).any() for k in weights), "the resumed run trained further"


def test_resume_errors_name_the_fix(platform):
    with pytest.raises(FileNotFoundError, match="no run 'no-such-run'.*--root"):
        platform.client.resume("no-such-run", root=str(platform.runs_root))


def test_continue_as_new_every_n_steps_carries_the_run_state(platform):
    """`loop.continue_as_new_every=2`: the workflow restarts its history every 2 steps and
    the run goes on where it was, each step recorded once."""
    from temporalio.api.enums.v1 import EventType

    handle = platform.client.submit(
        RECIPE_PATH, platform.overrides(*FAST, "loop.steps=5", "loop.continue_as_new_every=2", "tracking.name=can")
    )
    summary = handle.result(timeout=600)
    assert summary.steps == 5 and summary.policy_version == 5
    assert [m["step"] for m in metrics(Path(summary.run_uri))] == list(range(5))
    assert summary.reward_first10 > 0 and len(summary.eval_rewards) == 0
    # The last run of the chain starts from the carried state: it scheduled only step 4.
    events = handle.history().events
    assert events[0].workflow_execution_started_event_attributes.continued_execution_run_id
    trains = [e for e in events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
              and e.activity_task_scheduled_event_attributes.activity_type.name == "step"]  # fmt: skip
    assert len(trains) == 1
