"""LoRA (workers/lora.py) on the tiny model, in-process: only the adapters train, the
reference is the base with the adapters off, the engines get base + delta merged (exactly
peft's merge_and_unload), a checkpoint holds the adapter and its optimizer state only and
restores bit for bit, onto its own base only; FSDP2 with two gloo ranks; QLoRA refused
without CUDA (and trained in a `gpu` test)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ratchet.config.loader import ConfigError, load_config
from ratchet.config.schema import RunConfig
from ratchet.workers import lora
from ratchet.workers.checkpointing import checkpoint_bytes, load_trainer_state, read_meta, save_trainer_state
from ratchet.workers.policy_update import PolicyTrainer, response_logits, token_logprobs
from ratchet.workers.weight_sync import local_source
from ratchet.workers.weight_sync.buckets import gather_buckets
from ratchet.workers.weight_sync.trainer_side import check_finite_shards, sync_plan

from .test_trainer_checkpoint import free_port, make_step

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is (disabled, )?unavailable or uninitialized")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "copy_lora_grpo.yaml"
RANK, ALPHA = 4, 8.0


def make_cfg(model_path, *, rank: int = RANK, kl: float = 0.05, **lora_extra) -> RunConfig:
    return RunConfig.model_validate(
        {
            "seed": 0,
            "model": {"path": str(model_path)},
            "data": {"train_files": "unused.parquet"},
            "rollout": {"n": 4, "max_response_length": 6},
            # weight_decay 0: an adapter weight that got no gradient stays exactly as it was
            "trainer": {"lr": 1e-2, "micro_batch_size": 4, "weight_decay": 0.0,
                        "lora": {"rank": rank, "alpha": ALPHA, "target_modules": "all-linear", **lora_extra}},
            "algorithm": {"kl": {"coef": kl}},
        }
    )  # fmt: skip


def train(trainer: PolicyTrainer, seed: int) -> dict:
    return trainer.train_step(make_step(seed), kl_coef=trainer.cfg.algorithm.kl.coef).metrics


def logprobs(model, seed: int = 9) -> torch.Tensor:
    batch = make_step(seed).batch
    with torch.no_grad():
        return token_logprobs(response_logits(model.eval(), batch, 1.0), batch.response_ids)


def plain_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


@pytest.fixture(scope="module")
def trained(tiny_model):
    """A LoRA trainer after two updates (KL on), and the adapter weights before them."""
    trainer = PolicyTrainer(str(tiny_model), make_cfg(tiny_model))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = [train(trainer, seed) for seed in range(2)]
    return trainer, before, metrics


# --------------------------------------------------------------------------- what trains


def test_only_adapter_parameters_require_grad_and_are_optimised(trained):
    trainer, _, _ = trained
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # 7 linear layers per block (all-linear, not the tied head) x 4 blocks x (A, B)
    assert len(trainable) == 7 * 4 * 2
    optimised = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimised == {id(p) for n, p in trainer.model.named_parameters() if p.requires_grad}
    adapter = sum(p.numel() for p in lora.trainable_parameters(trainer.model))
    base = sum(p.numel() for p in trainer.model.parameters() if not p.requires_grad)
    assert adapter == 4 * RANK * (4 * 128 * 2 + 3 * (128 + 512))  # (in + out) x rank per linear
    assert adapter < base / 20
    assert trainer.reference is None  # KL on, yet no second copy of the model


def test_a_train_step_changes_only_adapter_weights(trained):
    trainer, before, metrics = trained
    after = dict(trainer.model.named_parameters())
    for name, old in before.items():
        if ".lora_" in name:
            continue
        assert torch.equal(after[name], old), f"base weight {name} changed"
    # B starts at zero (so A gets no gradient in the first update); after two updates both moved.
    assert all(not torch.equal(after[n], before[n]) for n in before if ".lora_B." in n)
    assert any(not torch.equal(after[n], before[n]) for n in before if ".lora_A." in n)
    assert metrics[0]["kl"] == 0.0  # update 1 starts at the base: policy = reference
    assert metrics[1]["kl"] > 0.0


def test_reference_is_the_base_with_the_adapter_off(trained, tiny_model):
    trainer, _, _ = trained
    batch = make_step(3).batch
    micro = trainer._micro_batches(batch)
    ref = trainer._reference_logprobs(batch, micro)
    base = plain_model(tiny_model).eval()
    with torch.no_grad():
        expected = token_logprobs(response_logits(base, batch, 1.0), batch.response_ids)
    assert torch.allclose(ref, expected, atol=1e-6, rtol=0)
    policy = trainer._logprobs(trainer.model, batch, micro)
    assert (policy - ref).abs().max() > 1e-3  # the adapter is back on outside the block


def test_no_kl_means_no_reference_pass(tiny_model):
    trainer = PolicyTrainer(str(tiny_model), make_cfg(tiny_model, kl=0.0))
    batch = make_step(0).batch
    assert trainer._reference_logprobs(batch, trainer._micro_batches(batch)) is None


# --------------------------------------------------------------------------- merged weights


def test_merged_weights_equal_peft_merge_and_unload(trained):
    trainer, _, _ = trained
    merged = trainer.full_state()
    expected = copy.deepcopy(trainer.model).merge_and_unload().state_dict()
    assert set(merged) == set(expected)  # the base model's own names, tied head included
    for name, t in expected.items():
        assert torch.equal(merged[name], t), name


def test_sync_sends_merged_weights_the_engine_loads_unchanged(trained, tiny_model):
    """The weight sync's own path (plan, buckets, gather) into the HF engine serving the
    base: after the sync its log-probs are the trainer's policy's."""
    from ratchet.workers.engines.hf import HFEngine

    trainer, _, _ = trained
    source = local_source(lora.sync_view(trainer.model), engine_dtype="float32", bucket_mb=0.05, version=trainer.version)
    manifest = source.manifest()
    engine = HFEngine(str(tiny_model))  # serves the base until the sync
    assert set(manifest.all_names) == set(engine.model.state_dict())
    assert len(manifest.buckets) > 3  # several buckets: each merged as it is gathered
    check_finite_shards(source.entries, "merged", world_size=1)
    assert (logprobs(engine.model) - logprobs(trainer.model)).abs().max() > 1e-3
    engine.load_weights(source.pairs())  # the engine's own contract: every parameter, by HF name
    assert torch.allclose(logprobs(engine.model), logprobs(trainer.model), atol=1e-5, rtol=0)


def test_non_finite_adapter_is_refused_before_a_sync(tiny_model):
    from ratchet.errors import NonFiniteError

    trainer = PolicyTrainer(str(tiny_model), make_cfg(tiny_model))
    name, param = next((n, p) for n, p in trainer.model.named_parameters() if ".lora_B." in n)
    with torch.no_grad():
        param[0, 0] = float("nan")
    entries, _ = sync_plan(lora.sync_view(trainer.model), engine_dtype="float32", bucket_mb=1, version=0)
    with pytest.raises(NonFiniteError):
        check_finite_shards(entries, "the weights", world_size=1)


# --------------------------------------------------------------------------- checkpoints


def test_checkpoint_holds_the_adapter_and_its_optimizer_state_only(trained, tiny_model, tmp_path):
    trainer, _, _ = trained
    save_trainer_state(trainer, tmp_path / "lora", {"step": 2})
    files = sorted((tmp_path / "lora").glob("*.safetensors"))
    keys = []
    for f in files:
        with safe_open(str(f), "pt") as st:
            keys += list(st.keys())
    model_keys = [k for k in keys if k.startswith("model/")]
    optim_keys = [k for k in keys if k.startswith("optim/")]
    assert len(model_keys) == 56 and all(".lora_" in k for k in model_keys)
    assert optim_keys and all(".lora_" in k for k in optim_keys)
    assert len(optim_keys) == 3 * 56  # exp_avg, exp_avg_sq, step per adapter weight
    meta = read_meta(tmp_path / "lora")
    assert meta["lora"]["rank"] == RANK and meta["lora"]["base"]["fingerprint"] == lora.base_of(trainer.model).fingerprint

    full = PolicyTrainer(str(tiny_model), make_cfg(tiny_model, rank=0))
    train(full, 0)
    save_trainer_state(full, tmp_path / "full", {"step": 1})
    lora_bytes, full_bytes = checkpoint_bytes(tmp_path / "lora"), checkpoint_bytes(tmp_path / "full")
    print(f"trainer state: LoRA rank {RANK} {lora_bytes} bytes, full policy {full_bytes} bytes")
    assert lora_bytes < full_bytes / 8


def test_restore_gives_a_bit_identical_adapter_and_next_step(trained, tiny_model, tmp_path):
    trainer, _, _ = trained
    trainer = copy.deepcopy(trainer)  # the module's trainer stays as the other tests expect it
    save_trainer_state(trainer, tmp_path / "ckpt", {"step": 2})
    rng = torch.get_rng_state()
    restored = PolicyTrainer(str(tiny_model), make_cfg(tiny_model))
    assert load_trainer_state(restored, tmp_path / "ckpt") == {"step": 2}
    assert restored.version == trainer.version == 2
    for (n, a), (m, b) in zip(trainer.model.named_parameters(), restored.model.named_parameters()):
        assert n == m and torch.equal(a, b), n
    torch.set_rng_state(rng)
    train(trainer, 7)
    torch.set_rng_state(rng)
    train(restored, 7)
    for (n, a), (_, b) in zip(trainer.model.named_parameters(), restored.model.named_parameters()):
        assert torch.equal(a, b), n
    merged_a, merged_b = trainer.full_state(), restored.full_state()
    assert all(torch.equal(merged_a[k], merged_b[k]) for k in merged_a)


def test_restore_onto_another_base_or_kind_is_refused(trained, tiny_model, tmp_path):
    from ratchet.models.tiny import build_tiny_model

    trainer, _, _ = trained
    save_trainer_state(trainer, tmp_path / "lora", {})
    other_base = build_tiny_model(tmp_path / "other", seed=1)
    with pytest.raises(lora.WrongBase, match="fingerprint"):
        load_trainer_state(PolicyTrainer(str(other_base), make_cfg(other_base)), tmp_path / "lora")
    with pytest.raises(lora.WrongBase, match="trainer.lora"):
        load_trainer_state(PolicyTrainer(str(tiny_model), make_cfg(tiny_model, rank=0)), tmp_path / "lora")
    full = PolicyTrainer(str(tiny_model), make_cfg(tiny_model, rank=0))
    save_trainer_state(full, tmp_path / "full", {})
    with pytest.raises(lora.WrongBase, match="whole policy"):
        load_trainer_state(PolicyTrainer(str(tiny_model), make_cfg(tiny_model)), tmp_path / "full")
    with pytest.raises(lora.WrongBase, match="set trainer.lora as it was"):  # same base, other target modules
        load_trainer_state(PolicyTrainer(str(tiny_model), make_cfg(tiny_model, target_modules=["q_proj"])), tmp_path / "lora")


def test_adapter_folder_loads_with_peft_on_its_base(trained, tiny_model, tmp_path):
    from peft import PeftModel

    trainer, _, _ = trained
    folder = lora.write_adapter_folder(trainer.model, lora.adapter_state(trainer.model), tmp_path / "hf")
    assert sorted(p.name for p in folder.iterdir()) == sorted([lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS, lora.ADAPTER_BASE])
    assert json.loads((folder / lora.ADAPTER_BASE).read_text())["fingerprint"] == lora.base_of(trainer.model).fingerprint
    loaded = PeftModel.from_pretrained(plain_model(tiny_model), str(folder))
    assert torch.allclose(logprobs(loaded), logprobs(trainer.model), atol=1e-6, rtol=0)
    assert (folder / lora.ADAPTER_WEIGHTS).stat().st_size < 0.15 * (Path(tiny_model) / "model.safetensors").stat().st_size


# --------------------------------------------------------------------------- config


def test_config_section_and_refusals(tiny_model):
    assert make_cfg(tiny_model, rank=0).trainer.lora.rank == 0 and lora.lora_settings(make_cfg(tiny_model, rank=0)) is None
    settings = lora.lora_settings(make_cfg(tiny_model))
    assert settings.rank == RANK and settings.scaling == ALPHA / RANK
    with pytest.raises(ValueError, match="trainer.lora.rank > 0"):
        make_cfg(tiny_model, rank=0, quantize="4bit")
    with pytest.raises(ValueError, match="needs CUDA"):
        RunConfig.model_validate(
            {**make_cfg(tiny_model).model_dump(), "trainer": {"device": "cpu", "lora": {"rank": 4, "quantize": "4bit"}}}
        )
    with pytest.raises(ValueError, match="one trainer rank"):
        RunConfig.model_validate(
            {**make_cfg(tiny_model).model_dump(), "trainer": {"world_size": 2, "lora": {"rank": 4, "quantize": "4bit"}}}
        )
    with pytest.raises(ValueError, match="target_modules is empty"):
        make_cfg(tiny_model, target_modules=[])
    with pytest.raises(ValueError, match="linear layers are named"):
        PolicyTrainer(str(tiny_model), make_cfg(tiny_model, target_modules=["attn_qkv"]))


def test_qlora_without_cuda_is_refused_when_the_trainer_starts(tiny_model):
    cfg = make_cfg(tiny_model, quantize="4bit")  # device auto: accepted at submit, the trainer's machine decides
    with pytest.raises(ConfigError, match=r"trainer.lora.quantize.*needs a CUDA GPU"):
        PolicyTrainer(str(tiny_model), cfg)


def test_example_config_loads():
    cfg = load_config(EXAMPLE, check_files=False)
    assert cfg.trainer.lora.rank > 0 and cfg.trainer.lora.quantize is None
    assert cfg.algorithm.kl.coef > 0  # the reference comes from the adapter-off base


# --------------------------------------------------------------------------- FSDP2


def _two_ranks(rank: int, port: int, model_path: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        trainer = PolicyTrainer(model_path, make_cfg(model_path), rank=rank, world_size=2)
        assert trainer.sharded and trainer.reference is None
        for seed in range(2):
            train(trainer, seed)
        merged = trainer.full_state()  # a collective
        adapter = lora.adapter_state(trainer.model)  # a collective: every rank, as start_checkpoint calls it
        # The sync's own path on two ranks: finiteness agreed over ranks, buckets gathered.
        entries, manifest = sync_plan(lora.sync_view(trainer.model), engine_dtype="float32", bucket_mb=0.05, version=trainer.version)
        check_finite_shards(entries, "the weights", world_size=2)
        synced = {name: torch.from_numpy(array.copy()) for bucket in gather_buckets(entries, manifest) for name, array in bucket.pairs()}
        save_trainer_state(trainer, Path(out) / "ckpt2", {"ranks": 2})
        from safetensors.torch import save_file

        if rank == 0:
            save_file({k: v.contiguous() for k, v in merged.items() if k != "lm_head.weight"}, str(Path(out) / "merged2.safetensors"))
            save_file(synced, str(Path(out) / "synced2.safetensors"))
            save_file(adapter, str(Path(out) / "adapter2.safetensors"))
        # 1 rank -> 2 ranks: the one-rank checkpoint resharded on load.
        restored = PolicyTrainer(model_path, make_cfg(model_path), rank=rank, world_size=2)
        load_trainer_state(restored, Path(out) / "ckpt1")
        merged = restored.full_state()
        if rank == 0:
            save_file({k: v.contiguous() for k, v in merged.items() if k != "lm_head.weight"}, str(Path(out) / "merged1to2.safetensors"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_train_lora_like_one_and_reshard_checkpoints(trained, tiny_model, tmp_path):
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    trainer, _, _ = trained
    save_trainer_state(trainer, tmp_path / "ckpt1", {"ranks": 1})
    mp.spawn(_two_ranks, args=(free_port(), str(tiny_model), str(tmp_path)), nprocs=2, join=True)
    merged2 = load_file(str(tmp_path / "merged2.safetensors"))
    merged1 = trainer.full_state()
    # Two ranks sum the gradients in another order than one, and AdamW's first steps move a
    # weight by about lr (1e-2) whatever its gradient's size, so a near-zero gradient's
    # rounding shows: over batch seeds 0-5 (AMD EPYC, torch 2.13 CPU) the adapters differed
    # by 1.5e-5 to 1.7e-4 and the merged weights by 6e-7 to 6.8e-6. The bounds sit 6x and
    # 15x above the largest; a rank's gradient left out would differ by about lr.
    assert max((merged2[k] - merged1[k]).abs().max().item() for k in merged2) < 1e-4
    synced2 = load_file(str(tmp_path / "synced2.safetensors"))
    assert set(synced2) == set(merged2) and all(torch.equal(synced2[k], merged2[k]) for k in merged2)
    adapter2, adapter1 = load_file(str(tmp_path / "adapter2.safetensors")), lora.adapter_state(trainer.model)
    assert set(adapter2) == set(adapter1) and max((adapter2[k] - adapter1[k]).abs().max().item() for k in adapter1) < 1e-3
    merged1to2 = load_file(str(tmp_path / "merged1to2.safetensors"))
    assert all(torch.equal(merged1to2[k], merged1[k]) for k in merged1to2)
    restored = PolicyTrainer(str(tiny_model), make_cfg(tiny_model))  # 2 ranks -> 1
    load_trainer_state(restored, tmp_path / "ckpt2")
    assert max((restored.full_state()[k] - merged2[k]).abs().max().item() for k in merged2) < 1e-5


# --------------------------------------------------------------------------- QLoRA


@pytest.mark.gpu
def test_qlora_trains_adapters_on_a_4bit_base(tiny_model):
    pytest.importorskip("bitsandbytes")
    cfg = make_cfg(tiny_model, quantize="4bit")
    trainer = PolicyTrainer(str(tiny_model), cfg)
    assert not trainer.sharded and trainer.device.type == "cuda"
    linear = trainer.model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert type(linear.weight).__name__ == "Params4bit"
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    for seed in range(2):
        train(trainer, seed)
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if p.requires_grad)
    merged = trainer.full_state()
    assert merged["model.layers.0.self_attn.q_proj.weight"].shape == (128, 128)
    assert all(torch.isfinite(t).all() for t in merged.values())


def test_the_sync_benchmark_measures_the_tiny_model(tiny_model, tmp_path):
    """benchmarks/lora_sync.py's measurement, once, without vLLM (docs/lora.md's table)."""
    from types import SimpleNamespace

    from ..benchmark_scripts import load_benchmark

    bench = load_benchmark("lora_sync")
    row = bench.measure("tiny", str(tiny_model), SimpleNamespace(rank=4, repeats=1, vllm=False, checkpoint=True, work=str(tmp_path)))
    assert row["merged_bytes"] == 4 * row["params"]  # float32, the tied head sent once
    assert row["adapter_bytes"] < row["merged_bytes"] / 5
    assert row["ckpt_lora_bytes"] < row["ckpt_full_bytes"] / 8
    assert all(row[k] >= 0 for k in ("plain_gather_s", "merged_gather_s", "adapter_write_s", "hf_load_s"))
