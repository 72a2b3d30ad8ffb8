"""Sharded trainer-state checkpoints (torch.distributed.checkpoint, safetensors files, JSON
meta): exact resume on one rank, resharding 2 -> 1 and 1 -> 2 gloo ranks (FSDP2), the
background write (the worker's start_checkpoint and restore), and that nothing on disk is a pickle."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from ratchet.config.schema import RunConfig
from ratchet.models.tiny import VOCAB
from ratchet.storage.layout import RunLayout
from ratchet.workers.batch import RolloutBatch, ScoredStep
from ratchet.workers.checkpointing import (
    load_trainer_state,
    read_meta,
    save_trainer_state,
    snapshot,
    write_snapshot,
)
from ratchet.workers.policy_update import PolicyTrainer
from ratchet.workers.runtime import enable_determinism

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PAD, BOS, EOS = VOCAB.index("<pad>"), VOCAB.index("<bos>"), VOCAB.index("<eos>")
DIGITS = [VOCAB.index(str(d)) for d in range(10)]
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 0.25, 0.0])
STEPS = 2  # updates before the save

# DCP warns on every single-process save/load; single-process is what these tests mean.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is (disabled, )?unavailable or uninitialized")


def make_cfg(model_path) -> RunConfig:
    # KL on: the trainer holds a frozen reference, which is rebuilt, not saved.
    return RunConfig.model_validate(
        {
            "seed": 0,
            "model": {"path": str(model_path)},
            "data": {"train_files": "unused.parquet"},
            "rollout": {"n": 4, "max_response_length": 6},
            "trainer": {"lr": 1e-2, "micro_batch_size": 2, "weight_decay": 0.01},
            "algorithm": {"kl": {"coef": 0.05}},
        }
    )


def make_step(seed: int) -> ScoredStep:
    """8 rows (2 prompts x 4 samples) of random digits, some responses ending early."""
    g = torch.Generator().manual_seed(seed)
    digits = torch.tensor(DIGITS)
    b, p, r = 8, 6, 6
    prompt = digits[torch.randint(0, 10, (b, p), generator=g)]
    prompt[:, 0] = BOS
    response = digits[torch.randint(0, 10, (b, r), generator=g)]
    mask = torch.ones(b, r)
    for row, length in {1: 2, 4: 4, 6: 3}.items():
        response[row, length - 1] = EOS
        response[row, length:] = PAD
        mask[row, length:] = 0.0
    batch = RolloutBatch(
        prompt_ids=prompt,
        prompt_mask=torch.ones(b, p, dtype=torch.long),
        response_ids=response,
        response_mask=mask,
        rollout_logprobs=-2.0 - torch.rand(b, r, generator=g),
        policy_version=torch.zeros(b, r, dtype=torch.long),
        prompt_index=torch.tensor([0] * 4 + [1] * 4),
        samples=[{}] * b,
    )
    return ScoredStep(batch, REWARDS, None)


def train(trainer: PolicyTrainer, seed: int) -> None:
    trainer.train_step(make_step(seed), kl_coef=trainer.cfg.algorithm.kl.coef)


def full_optimizer_state(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    """Unsharded AdamW state by `<param name>/<exp_avg|exp_avg_sq|step>` (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=StateDictOptions(full_state_dict=True))
    return {f"{name}/{k}": v.detach().clone() for name, entry in osd["state"].items() for k, v in entry.items()}


def assert_equal_states(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


# --------------------------------------------------------------------------- one rank


def test_resume_on_one_rank_is_bit_identical(tiny_model, tmp_path):
    cfg = make_cfg(tiny_model)
    original = PolicyTrainer(str(tiny_model), cfg)
    for i in range(STEPS):
        train(original, seed=i)
    save_trainer_state(original, tmp_path / "ckpt", {"step": STEPS, "note": "one rank"})
    saved_rng = torch.get_rng_state()

    torch.rand(100)  # moves the generator; the load puts it back
    restored = PolicyTrainer(str(tiny_model), cfg)  # also reseeds, and rebuilds the reference
    assert restored.version == 0 and not restored.optimizer.state
    extra = load_trainer_state(restored, tmp_path / "ckpt")
    assert extra == {"step": STEPS, "note": "one rank"}
    assert restored.version == original.version == STEPS
    assert torch.equal(torch.get_rng_state(), saved_rng)
    assert_equal_states(restored.full_state(), original.full_state())
    assert_equal_states(full_optimizer_state(restored), full_optimizer_state(original))
    assert restored.optimizer.param_groups[0]["betas"] == original.optimizer.param_groups[0]["betas"]
    assert restored.optimizer.param_groups[0]["lr"] == original.optimizer.param_groups[0]["lr"]

    # One more identical update on both: still bit-identical (moments and step counts restored).
    before = {k: v.clone() for k, v in original.full_state().items()}
    train(original, seed=99)
    train(restored, seed=99)
    assert restored.version == original.version == STEPS + 1
    assert any(not torch.equal(before[k], v) for k, v in original.full_state().items())
    assert_equal_states(restored.full_state(), original.full_state())
    assert_equal_states(full_optimizer_state(restored), full_optimizer_state(original))

    meta = read_meta(tmp_path / "ckpt")
    assert meta["version"] == STEPS and meta["world_size"] == 1 and meta["optimizer_state"]
    # The reference policy is not in the checkpoint: weights and moments of the policy only.
    from safetensors import safe_open

    (shard,) = (tmp_path / "ckpt").glob("*.safetensors")
    with safe_open(str(shard), "pt") as f:
        keys = set(f.keys())
    n_params = len(original.optimizer.state)
    assert keys == {*(f"model/{k}" for k in original.model.state_dict() if k != "lm_head.weight")} | {
        *(f"optim/{k}" for k in full_optimizer_state(original))
    } | {"rng/cpu/0", "version"}
    assert len([k for k in keys if k.startswith("optim/")]) == 3 * n_params


def test_state_saved_before_the_first_update_leaves_the_optimizer_fresh(tiny_model, tmp_path):
    cfg = make_cfg(tiny_model)
    trainer = PolicyTrainer(str(tiny_model), cfg)
    save_trainer_state(trainer, tmp_path / "ckpt", {})
    assert not trainer.optimizer.state  # saving did not initialise AdamW's state
    other = PolicyTrainer(str(tiny_model), cfg)
    train(other, seed=0)
    load_trainer_state(other, tmp_path / "ckpt")
    assert other.version == 0 and not other.optimizer.state
    assert_equal_states(other.full_state(), trainer.full_state())


def write_in_background(snap, local_dir: Path) -> tuple[threading.Thread, dict]:
    """`write_snapshot` in a thread of its own, as TrainerWorker.start_checkpoint runs it;
    the dict gets the folder's bytes when the write succeeded."""
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(bytes=write_snapshot(snap, local_dir)), daemon=True)
    thread.start()
    return thread, out


def test_worker_checkpoint_is_written_in_background_and_restored(tiny_model, tmp_path):
    """The product's path: `start_checkpoint` snapshots, a thread writes, exports and
    commits while training goes on; a fresh worker `restore`s the downloaded checkpoint
    (as recovery and a resume do) to the state at the snapshot."""
    from ratchet.storage.checkpoint_store import CheckpointStore
    from ratchet.storage.object_store import ObjectStore
    from ratchet.workers.trainer import TrainerWorker

    cfg = make_cfg(tiny_model)
    run = ObjectStore(str(tmp_path / "run"))
    worker = TrainerWorker(cfg, str(tiny_model), run.url, 0, 1)
    worker.setup(0)
    train(worker.trainer, seed=0)
    at_snapshot = {k: v.clone() for k, v in worker.trainer.full_state().items()}
    moments = full_optimizer_state(worker.trainer)
    started = worker.start_checkpoint(1, {"next_step": 1})
    assert (started.name, started.policy_version, started.error) == ("step-00000001", 1, None)
    train(worker.trainer, seed=1)  # changes the live weights while the write may still run
    assert worker.wait_checkpoint().error is None
    CheckpointStore(run).download("step-00000001", tmp_path / "ckpt")
    meta = read_meta(tmp_path / "ckpt" / RunLayout.TRAINER_STATE)
    assert meta["extra"] == {"step": 1, "policy_version": 1, "world_size": 1}

    other = TrainerWorker(cfg, str(tiny_model), str(tmp_path / "run2"), 0, 1)
    other.setup(0)
    assert other.restore(str(tmp_path / "ckpt")) == 1
    assert other.policy_version() == 1
    assert_equal_states(other.trainer.full_state(), at_snapshot)
    assert_equal_states(full_optimizer_state(other.trainer), moments)


def test_enable_determinism_trains_on_cpu(tiny_model):
    was = torch.are_deterministic_algorithms_enabled()
    try:
        enable_determinism(7)
        assert torch.are_deterministic_algorithms_enabled()
        first = torch.rand(3)
        enable_determinism(7)
        assert torch.equal(torch.rand(3), first)
        trainer = PolicyTrainer(str(tiny_model), make_cfg(tiny_model))
        train(trainer, seed=0)
        assert trainer.version == 1
    finally:
        torch.use_deterministic_algorithms(was)


@pytest.mark.slow
def test_deterministic_kernels_leave_inductor_unimported_and_set_it_when_imported():
    """A fresh process (as an actor's): the flag is on without Inductor's config imported
    (2 CPU-s that a reward worker has no other use for), and a later import of that config
    finds its `deterministic` flag set, as torch.use_deterministic_algorithms sets it."""
    probe = (
        "import sys, torch\n"
        "from ratchet.workers.runtime import enable_determinism\n"
        "enable_determinism(7)\n"
        "print(torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),"
        " 'torch._inductor.config' in sys.modules)\n"
        "import torch._inductor.config as c\n"
        "print(c.deterministic)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_DETERMINISTIC"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "False", "True"], out.stdout


# --------------------------------------------------------------------------- two ranks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _save_flat(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def _two_rank_worker(rank: int, port: int, model_path: str, one_rank_ckpt: str, out: str) -> None:
    """Rank `rank` of 2: train, save (sync and background), and load a 1-rank checkpoint."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        out_dir = Path(out)
        cfg = make_cfg(model_path)
        trainer = PolicyTrainer(model_path, cfg, rank=rank, world_size=2)
        for i in range(STEPS):
            train(trainer, seed=i)
        save_trainer_state(trainer, out_dir / "ckpt2", {"step": STEPS, "ranks": 2})
        weights, moments = trainer.full_state(), full_optimizer_state(trainer)
        if rank == 0:
            _save_flat(weights, out_dir / "weights2.safetensors")
            _save_flat(moments, out_dir / "moments2.safetensors")
        # The background write's DCP collectives run on their own group while the training
        # step's collectives use the default one.
        snap = snapshot(trainer, {"background": True})
        writing, written = write_in_background(snap, out_dir / "ckpt2-bg")
        train(trainer, seed=50)
        writing.join(timeout=120)
        assert written["bytes"] > 0

        # 1 rank -> 2 ranks
        restored = PolicyTrainer(model_path, cfg, rank=rank, world_size=2)
        extra = load_trainer_state(restored, one_rank_ckpt)
        weights, moments = restored.full_state(), full_optimizer_state(restored)
        if rank == 0:
            _save_flat(weights, out_dir / "weights1to2.safetensors")
            _save_flat(moments, out_dir / "moments1to2.safetensors")
            (out_dir / "loaded1to2.json").write_text(json.dumps({"extra": extra, "version": restored.version}))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_run(tiny_model, tmp_path_factory):
    """A 1-rank checkpoint (and its state), then the 2-rank worker's outputs."""
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("two-ranks")
    single = PolicyTrainer(str(tiny_model), make_cfg(tiny_model))
    for i in range(STEPS):
        train(single, seed=i)
    save_trainer_state(single, root / "ckpt1", {"step": STEPS, "ranks": 1})
    expected = {"weights": single.full_state(), "moments": full_optimizer_state(single)}
    mp.spawn(_two_rank_worker, args=(free_port(), str(tiny_model), str(root / "ckpt1"), str(root)), nprocs=2, join=True)
    return root, expected


@pytest.mark.slow
def test_save_with_two_ranks_load_with_one(tiny_model, two_rank_run):
    from safetensors.torch import load_file

    root, _ = two_rank_run
    assert sorted(p.name for p in (root / "ckpt2").iterdir()) == [
        "shard-00001-model-00001-of-00001.safetensors",
        "shard-00002-model-00001-of-00001.safetensors",
        RunLayout.TRAINER_META,
    ]
    assert read_meta(root / "ckpt2")["world_size"] == 2
    for ckpt, extra in (("ckpt2", {"step": STEPS, "ranks": 2}), ("ckpt2-bg", {"background": True})):
        restored = PolicyTrainer(str(tiny_model), make_cfg(tiny_model))
        assert load_trainer_state(restored, root / ckpt) == extra
        assert restored.version == STEPS
        assert_equal_states(restored.full_state(), load_file(str(root / "weights2.safetensors")))
        assert_equal_states(full_optimizer_state(restored), load_file(str(root / "moments2.safetensors")))


@pytest.mark.slow
def test_save_with_one_rank_load_with_two(two_rank_run):
    from safetensors.torch import load_file

    root, expected = two_rank_run
    loaded = json.loads((root / "loaded1to2.json").read_text())
    assert loaded == {"extra": {"step": STEPS, "ranks": 1}, "version": STEPS}
    assert_equal_states(load_file(str(root / "weights1to2.safetensors")), expected["weights"])
    assert_equal_states(load_file(str(root / "moments1to2.safetensors")), expected["moments"])


# --------------------------------------------------------------------------- no pickles


PICKLE_PROTOCOL_OPCODE = 0x80  # every pickle of protocol >= 2 starts with PROTO
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default container (a zip holding data.pkl)


@pytest.mark.slow
def test_nothing_on_disk_is_a_pickle(two_rank_run):
    """Every file is a safetensors file (an 8-byte little-endian header length, then a JSON
    header) or JSON; DCP writes no `.metadata` pickle and no byte (torch.save) items."""
    from safetensors import safe_open

    root, _ = two_rank_run
    folders = [root / "ckpt1", root / "ckpt2", root / "ckpt2-bg"]
    seen = 0
    for folder in folders:
        names = sorted(p.name for p in folder.rglob("*"))
        assert ".metadata" not in names and RunLayout.TRAINER_META in names, names
        for path in folder.rglob("*"):
            data = path.read_bytes()
            assert data[0] != PICKLE_PROTOCOL_OPCODE and not data.startswith(ZIP_MAGIC), path
            if path.name == RunLayout.TRAINER_META:
                json.loads(data)
            else:
                assert path.suffix == ".safetensors", path
                header_len = int.from_bytes(data[:8], "little")
                header = json.loads(data[8 : 8 + header_len])
                body = len(data) - 8 - header_len
                assert max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__") == body
                assert "DCP_SHARDING_INFO" in header["__metadata__"]
                with safe_open(str(path), "pt") as f:
                    assert all(f.get_tensor(k).numel() >= 0 for k in f.keys())
            seen += 1
    assert seen == 2 + 3 + 3
