"""The colocated sync and hand-over on a GPU (weight_sync/colocated_process.py): a trainer
(FSDP2, bf16, NCCL at world size 1) and an HF engine in a process of its own on the same
GPU, the weights passed by CUDA IPC handles; the engine's sleep frees its GPU memory. The
same code runs on CPU over shared memory in tests/unit/test_colocated_process.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ratchet.workers.policy_update import PolicyTrainer
from ratchet.workers.weight_sync.colocated_process import ColocatedEngine, weights_digest
from ratchet.workers.weight_sync.trainer_side import sync_plan

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[1, 5, 6, 7, 17], [1, 8, 9, 3, 17]]


@pytest.fixture(scope="module")
def engine(tiny_model):
    with ColocatedEngine(timeout_s=180) as engine:
        engine.load(str(tiny_model), "bfloat16")
        yield engine


@pytest.fixture
def trainer(tiny_model, gpu_config):
    trainer = PolicyTrainer(str(tiny_model), gpu_config(tiny_model, trainer={"device": "cuda"}))
    yield trainer
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_sync_by_cuda_ipc_handles_leaves_the_engine_with_the_trainers_weights(engine, trainer):
    assert trainer.device.type == "cuda" and trainer.sharded and dist.get_backend() == "nccl"
    before = engine.greedy(PROMPTS, 8)
    g = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for p in trainer.model.parameters():
            local = p.to_local()
            local.add_(0.2 * torch.randn(local.shape, generator=g, device=local.device))
    result = engine.sync_from(trainer.model, engine_dtype="bfloat16", bucket_mb=0.25, version=1)
    entries, manifest = sync_plan(trainer.model, engine_dtype="bfloat16", bucket_mb=0.25, version=1)
    assert result.buckets == len(manifest.buckets) > 5 and 1 <= result.window_peak <= 2
    assert engine.digest() == weights_digest(entries, manifest)
    assert engine.greedy(PROMPTS, 8) != before


def test_sleep_releases_the_engines_gpu_memory_and_wake_up_takes_it_back(engine):
    before = engine.greedy(PROMPTS, 8)
    slept = engine.sleep()
    assert slept.device == "cuda" and slept.weight_bytes > 1_000_000  # the tiny model's ~2 MB of bf16 weights
    # Before: the weights and cuBLAS's 32 MiB workspace (H200); after: nothing (0 B measured there).
    assert slept.allocated_before >= slept.weight_bytes and slept.allocated_after < 0.05 * slept.weight_bytes
    woke = engine.wake_up()
    assert woke.allocated_after >= woke.weight_bytes == slept.weight_bytes
    assert engine.greedy(PROMPTS, 8) == before


def test_an_asleep_engine_refuses_to_generate(engine):
    engine.sleep()
    try:
        with pytest.raises(RuntimeError, match="asleep"):
            engine.greedy(PROMPTS, 4)
    finally:
        engine.wake_up()
