"""A LoRA run through the real workflow (Temporal + Ray): its checkpoint holds the adapter
alone (trainer state and a peft adapter folder, naming the base it needs), a resume
restores the adapter, and the rollout engine serves base + adapter merged: the stored
rollout log-probs of the step after the resume are those of the warm-up base with the
checkpoint's adapter on, not those of the base alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ratchet.platform.client import RECIPE_PATH
from ratchet.storage.batch_store import BatchStore
from ratchet.storage.checkpoint_store import CheckpointStore
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.layout import RunLayout

pytestmark = pytest.mark.integration

LORA = ["trainer.lora.rank=4", "trainer.lora.alpha=16", "trainer.lr=0.02", "algorithm.kl.coef=0.01"]
FAST = ["warmup.steps=2", "data.eval_files=null", "loop.prompts_per_step=4", "rollout.n=4", "checkpoint.every=2",
        "resources.trainer_cpus=0.5"]  # fmt: skip


def test_lora_checkpoint_resume_and_merged_sync(platform):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ratchet.workers.batch import load_step
    from ratchet.workers.policy_update import response_logits, token_logprobs

    client = platform.client
    first = client.submit(RECIPE_PATH, platform.overrides(*FAST, *LORA, "loop.steps=2", "tracking.name=lora")).result(timeout=600)
    assert first.steps == 2 and first.policy_version == 2
    run_dir = Path(first.run_uri)

    # The checkpoint: adapter + AdamW moments, and the adapter in peft's layout; no model.
    name = RunLayout.checkpoint_name(2)
    info = CheckpointStore(ObjectStore(first.run_uri)).get(name)
    files = set(info.files)
    assert {"hf/adapter_config.json", "hf/adapter_model.safetensors", "hf/ratchet_base.json"} <= files
    assert not any(f.endswith(("model.safetensors", "config.json")) and "/adapter_" not in f for f in files if f.startswith("hf/"))
    ckpt = run_dir / "checkpoints" / name
    total = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    model_bytes = (Path(platform.assets.model) / "model.safetensors").stat().st_size
    assert total < model_bytes / 2, (total, model_bytes)  # a full checkpoint is ~3x the model (weights + 2 moments)
    meta = json.loads((ckpt / "trainer" / "trainer_meta.json").read_text())
    assert meta["lora"]["rank"] == 4
    assert json.loads((ckpt / "hf" / "ratchet_base.json").read_text())["fingerprint"] == meta["lora"]["base"]["fingerprint"]

    # Resume: one more step from the adapter checkpoint.
    second = client.resume(first.run_id, ["loop.steps=3"], root=str(platform.runs_root)).result(timeout=600)
    assert second.steps == 3 and second.policy_version == 3
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2], "each step's metrics exactly once"
    assert lines[2]["kl"] > 0  # the restored adapter is not the base (the reference)

    # Batch 2 was generated after the resume by an engine synced from the restored trainer:
    # its log-probs are the merged policy's (warm-up base + step-2 adapter), not the base's.
    batch = load_step(BatchStore(ObjectStore(first.run_uri)), 2).batch
    mask = batch.response_mask.bool()
    base = AutoModelForCausalLM.from_pretrained(str(run_dir / RunLayout.WARMUP_MODEL)).eval()
    base_names = set(base.state_dict())
    with torch.no_grad():
        base_lp = token_logprobs(response_logits(base, batch, 1.0), batch.response_ids)
        merged = PeftModel.from_pretrained(base, str(ckpt / "hf")).eval()
        merged_lp = token_logprobs(response_logits(merged, batch, 1.0), batch.response_ids)
    served = batch.rollout_logprobs
    assert (merged_lp - served).abs()[mask].max().item() < 1e-4
    assert (base_lp - served).abs()[mask].max().item() > 1e-3, "the engine would serve the base alone"
    # The trainer saw the same numbers (its log-probs vs the rollout's, in every step).
    assert all(m["logprob_diff"] < 1e-4 for m in lines), [m["logprob_diff"] for m in lines]

    # The final export is a whole Hugging Face model: base + adapter merged.
    final = AutoModelForCausalLM.from_pretrained(second.final_policy_uri)
    assert set(final.state_dict()) == base_names
