"""The trainer on CUDA: NCCL, FSDP2 with bf16 mixed precision and activation checkpointing
(needs a GPU; the same code runs on CPU in tests/unit/test_fsdp_wrapping.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ratchet.workers.batch import ScoredStep
from ratchet.workers.policy_update import PolicyTrainer
from tests.batches import REWARDS, make_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def leave_no_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_trainer_on_cuda_with_nccl_bf16_and_checkpointing(tiny_model, gpu_config):
    from torch.distributed.fsdp import FSDPModule

    cfg = gpu_config(tiny_model, trainer={"device": "cuda", "activation_checkpointing": True, "micro_batch_size": 4})
    trainer = PolicyTrainer(str(tiny_model), cfg)
    assert trainer.device.type == "cuda" and trainer.sharded and trainer.plan.mixed_precision
    assert dist.get_backend() == "nccl" and isinstance(trainer.model, FSDPModule)
    assert trainer.units == ["LlamaDecoderLayer"]
    batch = make_batch(seed=4, rows=8, vocab=21)  # the tiny model's vocabulary
    before = {k: v.float().cpu().clone() for k, v in trainer.full_state().items()}
    metrics = trainer.train_step(ScoredStep(batch, REWARDS, None), kl_coef=0.0).metrics
    after = {k: v.float().cpu() for k, v in trainer.full_state().items()}
    assert all(v.dtype == torch.float32 for v in trainer.full_state().values())  # fp32 master weights
    assert max((after[k] - before[k]).abs().max().item() for k in after) > 1e-5

    cpu = PolicyTrainer(str(tiny_model), gpu_config(tiny_model, trainer={"device": "cpu", "micro_batch_size": 4}))
    cpu_metrics = cpu.train_step(ScoredStep(batch, REWARDS, None), kl_coef=0.0).metrics
    assert metrics["pg_loss"] == pytest.approx(cpu_metrics["pg_loss"], abs=2e-2)
    assert metrics["grad_norm"] == pytest.approx(cpu_metrics["grad_norm"], rel=5e-2)
    # The weights come back to the host for a sync.
    assert all(a.dtype.kind == "f" for a in trainer.state_numpy().values())


def test_cuda_trainer_refuses_to_run_without_a_group_of_its_size(tiny_model, gpu_config):
    cfg = gpu_config(tiny_model, trainer={"device": "cuda"})
    with pytest.raises(RuntimeError, match="join the process group"):
        PolicyTrainer(str(tiny_model), cfg, rank=0, world_size=2)
