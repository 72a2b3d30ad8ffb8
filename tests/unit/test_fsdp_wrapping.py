"""FSDP2 wrapping of any Hugging Face decoder by its `_no_split_modules`, activation
checkpointing and bf16 mixed precision, on CPU with gloo (the same code runs on CUDA with
NCCL: tests/gpu/test_cuda_trainer.py).

Each family is a tiny random model (2 layers, hidden 64, head size 32) built from its own
config class, so the wrapping is checked on the real module trees of Llama, Qwen2, Qwen3,
Mistral and Gemma, not on the tiny digit model alone."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ratchet.workers.batch import RolloutBatch, ScoredStep
from ratchet.workers.policy_update import PolicyTrainer
from ratchet.workers.sharding import unit_classes
from tests.batches import REWARDS, make_batch
from tests.configs import make_cfg

VOCAB = 96
FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma"]


def family_config(family: str):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
        "gemma": transformers.GemmaConfig,
    }[family]
    extra = {"head_dim": 32} if family in ("qwen3", "gemma") else {}
    return cls(**common, **extra)


@pytest.fixture(scope="module")
def family_models(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    out = {}
    for family in FAMILIES:
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(family) / "model"
        AutoModelForCausalLM.from_config(family_config(family)).save_pretrained(path)
        out[family] = path
    return out


@pytest.fixture(scope="module", autouse=True)
def leave_no_process_group():
    """A sharded single rank joins a one-rank gloo group in this process; drop it after the
    module so later tests see no default group."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def step(trainer: PolicyTrainer, batch: RolloutBatch) -> dict[str, float]:
    return trainer.train_step(ScoredStep(batch, REWARDS, None), kl_coef=trainer.cfg.algorithm.kl.coef).metrics


def cfg_for(path, **trainer):
    return make_cfg(path, trainer={"lr": 1e-3, "micro_batch_size": 4, **trainer}, algorithm={"kl": {"coef": 0.05}})


def worst_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_wraps_by_no_split_modules_and_trains_like_unsharded(family, family_models):
    """World size 1: the decoder blocks named by `_no_split_modules` become FSDP units (the
    reference policy too), and the sharded update equals the plain one."""
    from torch.distributed.fsdp import FSDPModule

    path = str(family_models[family])
    batch = make_batch()
    plain = PolicyTrainer(path, cfg_for(path))
    plain_metrics = step(plain, batch)

    sharded = PolicyTrainer(path, cfg_for(path), shard=True)
    expected_class = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "gemma": "Gemma"}[family]
    assert sharded.units == [f"{expected_class}DecoderLayer"]
    for model in (sharded.model, sharded.reference):
        blocks = [m for m in model.modules() if type(m).__name__.endswith(f"{expected_class}DecoderLayer")]
        assert len(blocks) == 2 and all(isinstance(b, FSDPModule) for b in blocks)
        assert isinstance(model, FSDPModule)
    before = {k: v.clone() for k, v in sharded.full_state().items()}
    sharded_metrics = step(sharded, batch)
    after = sharded.full_state()

    assert worst_difference(after, before) > 1e-4  # it did update
    assert worst_difference(after, plain.full_state()) < 1e-5
    for key in ("pg_loss", "kl", "entropy", "grad_norm"):
        assert sharded_metrics[key] == pytest.approx(plain_metrics[key], abs=1e-5), key


def test_activation_checkpointing_recomputes_and_gives_the_same_update(family_models):
    """Same loss, gradient norm and updated weights with and without recomputation, plain
    and sharded; each decoder block's forward runs twice per training micro-batch."""
    path = str(family_models["qwen3"])
    batch = make_batch(seed=1)
    reference = PolicyTrainer(path, cfg_for(path))
    ref_metrics = step(reference, batch)
    for shard in (False, True):
        trainer = PolicyTrainer(path, cfg_for(path, activation_checkpointing=True), shard=shard)
        assert trainer.model.is_gradient_checkpointing
        calls = []
        block = next(m for m in trainer.model.modules() if type(m).__name__.endswith("Qwen3DecoderLayer"))
        # A pre-hook: the recomputation stops as soon as it has what the backward needs
        # (torch's early stop), before a forward hook would fire.
        block.register_forward_pre_hook(lambda module, args: calls.append(module.training))
        metrics = step(trainer, batch)
        # 2 micro-batches of 4 rows: 2 training forwards and 2 recomputations in the
        # backward pass; no old-log-prob forward (eval): one pass takes them from its own.
        assert calls.count(False) == 0 and calls.count(True) == 4, calls
        for key in ("pg_loss", "kl", "entropy", "grad_norm"):
            assert metrics[key] == pytest.approx(ref_metrics[key], abs=1e-6), (shard, key)
        assert worst_difference(trainer.full_state(), reference.full_state()) < 1e-6


def test_bf16_mixed_precision_computes_in_bf16_keeps_fp32_weights(family_models):
    """trainer.mixed_precision=bf16: blocks see bf16 activations, the weights and the
    optimizer stay fp32, and the update is close to the fp32 one (bf16 rounding)."""
    path = str(family_models["llama"])
    batch = make_batch(seed=2)
    fp32 = PolicyTrainer(path, cfg_for(path))
    fp32_metrics = step(fp32, batch)
    mixed = PolicyTrainer(path, cfg_for(path, mixed_precision="bf16"))
    assert mixed.sharded and mixed.plan.mixed_precision
    dtypes = []
    block = next(m for m in mixed.model.modules() if type(m).__name__.endswith("LlamaDecoderLayer"))
    block.register_forward_hook(lambda module, args, out: dtypes.append((out[0] if isinstance(out, tuple) else out).dtype))
    before = {k: v.clone() for k, v in mixed.full_state().items()}
    metrics = step(mixed, batch)
    assert set(dtypes) == {torch.bfloat16}
    state = mixed.full_state()
    assert {v.dtype for v in state.values()} == {torch.float32}
    assert metrics["pg_loss"] == pytest.approx(fp32_metrics["pg_loss"], abs=2e-2)
    assert metrics["grad_norm"] == pytest.approx(fp32_metrics["grad_norm"], rel=5e-2)
    # AdamW's first step moves each weight by about lr (1e-3) times the gradient's sign:
    # the bf16 update points the same way as the fp32 one, not bit for bit.
    fp32_state = fp32.full_state()
    delta_mixed = torch.cat([(state[k] - before[k]).flatten() for k in sorted(state)])
    delta_fp32 = torch.cat([(fp32_state[k] - before[k]).flatten() for k in sorted(state)])
    cosine = torch.nn.functional.cosine_similarity(delta_mixed, delta_fp32, dim=0).item()
    assert cosine > 0.9, cosine
    assert 0 < worst_difference(state, fp32_state) <= 2.2e-3


def test_a_model_without_no_split_modules_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="_no_split_modules"):
        unit_classes(model)


def test_cuda_device_without_a_gpu_is_a_clear_error(family_models):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    path = str(family_models["llama"])
    with pytest.raises(RuntimeError, match="trainer.device=cuda but this process sees no GPU"):
        PolicyTrainer(path, cfg_for(path, device="cuda"))


def test_unknown_device_is_refused_by_the_schema(family_models):
    from ratchet.config import ConfigError

    with pytest.raises(ConfigError, match="trainer.device"):
        cfg_for(family_models["llama"], device="gpu")


# --------------------------------------------------------------------------- 2 gloo ranks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, path: str, cfg_json: str, out: str) -> None:
    """One of two trainer ranks (spawned): joins gloo the way TrainerWorker.setup does."""
    from safetensors.torch import save_file

    from ratchet.config.schema import RunConfig
    from ratchet.workers.runtime import join_process_group, resolve_device

    torch.set_num_threads(1)
    cfg = RunConfig.model_validate_json(cfg_json)
    assert join_process_group(resolve_device(cfg.trainer.device, rank), rank, 2, port) == "gloo"
    try:
        trainer = PolicyTrainer(path, cfg, rank=rank, world_size=2)
        metrics = step(trainer, make_batch(seed=3))
        state = trainer.full_state()
        if rank == 0:
            save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out, "weights.safetensors"))
            Path(out, "metrics.json").write_text(json.dumps({**metrics, "units": trainer.units}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_with_checkpointing_match_one_rank(family_models, tmp_path):
    """Qwen2 over 2 gloo ranks, blocks wrapped by `_no_split_modules`, with activation
    checkpointing: the same weights and metrics as one plain rank."""
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    path = str(family_models["qwen2"])
    cfg = cfg_for(path, micro_batch_size=2, activation_checkpointing=True)
    single = PolicyTrainer(path, cfg_for(path, micro_batch_size=2))
    single_metrics = step(single, make_batch(seed=3))
    mp.spawn(_rank, args=(free_port(), path, cfg.model_dump_json(), str(tmp_path)), nprocs=2, join=True)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["units"] == ["Qwen2DecoderLayer"]
    assert worst_difference(load_file(str(tmp_path / "weights.safetensors")), single.full_state()) < 1e-5
    for key in ("pg_loss", "kl", "entropy", "grad_norm"):
        assert metrics[key] == pytest.approx(single_metrics[key], abs=1e-5), key


def test_sharded_single_rank_checkpoint_round_trip(family_models, tmp_path):
    """One sharded rank (what a CUDA trainer always is): its trainer state saves and loads
    exactly (DCP over the one-rank mesh), and training goes on identically."""
    from ratchet.workers.checkpointing import load_trainer_state, save_trainer_state

    path = str(family_models["mistral"])
    cfg = cfg_for(path, mixed_precision="bf16")
    trainer = PolicyTrainer(path, cfg)
    step(trainer, make_batch(seed=5))
    save_trainer_state(trainer, tmp_path / "ckpt")
    restored = PolicyTrainer(path, cfg)
    load_trainer_state(restored, tmp_path / "ckpt")
    assert restored.version == 1 and restored.sharded
    assert worst_difference(restored.full_state(), trainer.full_state()) == 0.0
    again, resumed = step(trainer, make_batch(seed=6)), step(restored, make_batch(seed=6))
    assert again["pg_loss"] == resumed["pg_loss"] and again["grad_norm"] == resumed["grad_norm"]
