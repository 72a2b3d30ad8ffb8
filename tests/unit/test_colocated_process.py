"""A trainer and an HF engine in a process of its own, colocated without Ray
(weight_sync/colocated_process.py): the sync runs the CUDA IPC transport's own code, with
CPU shared memory standing in for the CUDA IPC handles (torch's reductions pick the
transport by device); tests/gpu/test_colocated_cuda.py runs it on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ratchet.models.tiny import build_tiny_model
from ratchet.workers.policy_update import PolicyTrainer
from ratchet.workers.weight_sync.colocated_process import ColocatedEngine, weights_digest
from ratchet.workers.weight_sync.trainer_side import sync_plan
from tests.configs import make_cfg

torch.set_num_threads(1)

PROMPTS = [[1, 5, 6, 7, 17], [1, 8, 9, 3, 17]]
BUCKET_MB = 0.25  # the tiny model (~4 MB in float32) in several buckets


# Each test starts an engine process of its own or shares the module one (seconds each).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(tiny_model):
    with ColocatedEngine(timeout_s=120) as engine:
        engine.load(str(tiny_model), "float32")
        yield engine


@pytest.fixture
def trainer(tiny_model):
    """FSDP2 at world size 1 (gloo), as a trainer on a GPU is always sharded."""
    trainer = PolicyTrainer(str(tiny_model), make_cfg(tiny_model, trainer={"device": "cpu"}), shard=True)
    yield trainer
    if dist.is_initialized():
        dist.destroy_process_group()


def perturb(trainer: PolicyTrainer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.model.parameters():
            local = p.to_local()  # a DTensor: this rank's shard (all of it at world size 1)
            local.add_(0.2 * torch.randn(local.shape, generator=g))


def test_a_sync_leaves_the_engine_with_the_trainers_weights(engine, trainer):
    before = engine.greedy(PROMPTS, 8)
    perturb(trainer, seed=1)
    result = engine.sync_from(trainer.model, engine_dtype="float32", bucket_mb=BUCKET_MB, version=1)
    entries, manifest = sync_plan(trainer.model, engine_dtype="float32", bucket_mb=BUCKET_MB, version=1)
    assert result.buckets == len(manifest.buckets) > 5 and 1 <= result.window_peak <= 2
    assert result.bytes == manifest.total_bytes and result.seconds > 0
    got, want = engine.digest(), weights_digest(entries, manifest)
    assert got.keys() == want.keys() and all(got[k] == v for k, v in want.items())
    assert engine.greedy(PROMPTS, 8) != before  # it serves the new weights


def test_bf16_on_the_wire_is_loaded_exactly(engine, trainer):
    perturb(trainer, seed=2)
    engine.sync_from(trainer.model, engine_dtype="bfloat16", bucket_mb=BUCKET_MB, version=2)
    entries, manifest = sync_plan(trainer.model, engine_dtype="bfloat16", bucket_mb=BUCKET_MB, version=2)
    assert engine.digest() == weights_digest(entries, manifest)


def test_an_engine_of_another_model_refuses_the_sync_and_the_trainer_does_not_hang(tmp_path, trainer):
    other = build_tiny_model(tmp_path / "other", layers=2)
    with ColocatedEngine(timeout_s=120) as engine:
        engine.load(str(other), "float32")
        digest = engine.digest()
        with pytest.raises(RuntimeError, match="do not match the rollout model's parameters"):
            engine.sync_from(trainer.model, engine_dtype="float32", bucket_mb=BUCKET_MB, version=1)
        assert engine.digest() == digest  # nothing was loaded


def test_sleep_and_wake_up_keep_the_answers_and_free_nothing_on_cpu(engine):
    before = engine.greedy(PROMPTS, 8)
    slept, woke = engine.sleep(), engine.wake_up()
    assert slept.device == woke.device == "cpu" and slept.allocated_after == 0
    assert engine.greedy(PROMPTS, 8) == before


def test_a_dead_engine_process_is_an_error_not_a_hang(tiny_model):
    engine = ColocatedEngine(timeout_s=120)
    engine.process.kill()
    engine.process.join(timeout=30)
    with pytest.raises(RuntimeError, match="the engine process died"):
        engine.load(str(tiny_model), "float32")
    engine.close()
