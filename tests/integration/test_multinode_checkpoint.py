"""Trainer ranks that share no disk: two ranks, each with a node-local folder of its own
(a different $RATCHET_CACHE_DIR per actor, as two nodes would have), checkpoint into the
object store and are restored from it alone after both folders are gone (real Ray, gloo
on CPU); and the process group's rendezvous on a node's network address instead of
127.0.0.1 (two processes, no Ray). The same on S3, with the ranks on two Ray nodes that
die, is tests/e2e/test_node_failure.py."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch

from ratchet.storage.checkpoint_store import CheckpointStore
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.layout import RunLayout

from ..faults.test_worker_faults import TINY, stored_step

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is (disabled, )?unavailable or uninitialized")

RUN_OVERRIDES = ("trainer.world_size=2", "rollout.n=4", "loop.prompts_per_step=2", "checkpoint.keep_last=2")
SHARDS = ["trainer/shard-00001-model-00001-of-00001.safetensors", "trainer/shard-00002-model-00001-of-00001.safetensors"]


# --------------------------------------------------------------------------- rendezvous


def _non_loopback_ipv4() -> str | None:
    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def _rendezvous_rank(rank: int, host: str, port: int, out: str) -> None:
    import torch.distributed as dist

    from ratchet.workers.runtime import join_process_group

    torch.set_num_threads(1)
    os.environ.pop("GLOO_SOCKET_IFNAME", None)
    try:
        assert join_process_group(torch.device("cpu"), rank, 2, port, master_addr=host, local_addr=host) == "gloo"
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        Path(out, f"rank{rank}.json").write_text(
            json.dumps({"sum": t.item(), "ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "addr": os.environ["MASTER_ADDR"]})
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_process_group_meets_on_the_nodes_address(tmp_path):
    """Rank 0's TCPStore on the machine's network address, found by a port probe bound
    there, and gloo pinned to the interface holding it (the host name resolves to
    127.0.0.1 here, which ranks on another node could not reach)."""
    import torch.multiprocessing as mp

    from ratchet.workers.runtime import free_port, interface_of, is_loopback

    host = _non_loopback_ipv4()
    if host is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and not is_loopback(host) and not is_loopback("head-node")
    mp.spawn(_rendezvous_rank, args=(host, free_port(host), str(tmp_path)), nprocs=2, join=True)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["sum"] for s in seen] == [3.0, 3.0]
    assert [s["addr"] for s in seen] == [host, host]
    assert [s["ifname"] for s in seen] == [interface_of(host)] * 2 and seen[0]["ifname"] != "lo"


# --------------------------------------------------------------------------- the store, several writers


def test_checkpoint_from_several_writers_is_sealed_once_all_uploaded(tmp_path):
    """Two writers (two nodes' folders) upload into one checkpoint; the manifest lists
    both, and only files that are stored: a writer's file missing from the store is
    refused. A reader can fetch one folder only (a restoring rank: `trainer/`)."""
    from ratchet.storage.manifest import FileEntry

    ckpts = CheckpointStore(ObjectStore(str(tmp_path / "run")))
    node0, node1 = tmp_path / "n0", tmp_path / "n1"
    (node0 / "trainer").mkdir(parents=True)
    (node1 / "trainer").mkdir(parents=True)
    (node0 / "trainer" / "shard-1.safetensors").write_bytes(b"zero" * 100)
    (node0 / "trainer" / "trainer_meta.json").write_text("{}")
    (node0 / "run_state.json").write_text('{"next_step": 3}')
    (node1 / "trainer" / "shard-2.safetensors").write_bytes(b"one" * 50)

    ckpts.begin("step-00000003")
    uploads = [ckpts.upload("step-00000003", node0), ckpts.upload("step-00000003", node1)]
    assert ckpts.list() == [], "uploaded but not sealed: it does not exist"
    with pytest.raises(FileNotFoundError, match="files not uploaded: trainer/shard-3.safetensors"):
        ckpts.seal("step-00000003", {**uploads[0], **uploads[1], "trainer/shard-3.safetensors": FileEntry(1, "0" * 64)}, {"step": 3})
    info = ckpts.seal("step-00000003", {**uploads[0], **uploads[1]}, {"step": 3})
    assert sorted(info.files) == [
        "run_state.json",
        "trainer/shard-1.safetensors",
        "trainer/shard-2.safetensors",
        "trainer/trainer_meta.json",
    ]
    assert info.files["trainer/shard-2.safetensors"]["size"] == 150 and info.total_bytes == 400 + 2 + 16 + 150
    assert ckpts.verify("step-00000003")

    out = tmp_path / "restore"
    ckpts.download("step-00000003", out, under=RunLayout.TRAINER_STATE)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "trainer/shard-1.safetensors", "trainer/shard-2.safetensors", "trainer/trainer_meta.json",
    ]  # fmt: skip
    # A retry under the same name that no longer has a file: it writes into an attempt
    # folder of its own while the committed checkpoint stays; the old files go after the manifest.
    attempt = ckpts.begin("step-00000003")
    assert attempt.startswith("attempt-") and ckpts.list() == [info]
    info = ckpts.seal("step-00000003", ckpts.upload("step-00000003", node0, attempt), {"step": 3}, attempt)
    assert "trainer/shard-2.safetensors" not in info.files and ckpts.verify("step-00000003")
    assert not any(k.endswith("shard-2.safetensors") for k in ckpts.store.list(RunLayout.CHECKPOINTS))


# --------------------------------------------------------------------------- two ranks, two "nodes"


def _full_state(worker) -> dict:
    """Unsharded weights and AdamW state, the version and this rank's RNG (every rank calls:
    unsharding is a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    t = worker.trainer
    osd = get_optimizer_state_dict(t.model, t.optimizer, options=StateDictOptions(full_state_dict=True))
    return {
        "version": t.version,
        "weights": {k: v.detach().clone() for k, v in t.full_state().items()},
        "optim": {f"{n}/{k}": v.detach().clone() for n, e in osd["state"].items() for k, v in e.items()},
        "rng": torch.get_rng_state(),
    }


def _restore_folders(worker, run_id: str) -> list[str]:
    from ratchet.workers.local_paths import private_subdir

    return [p.name for p in private_subdir("restore").iterdir() if p.name.startswith(f"{run_id}-")]


def assert_same(got: list[dict], want: list[dict]) -> None:
    """Bit for bit, rank by rank."""
    for g, w in zip(got, want, strict=True):
        assert g["version"] == w["version"]
        assert torch.equal(g["rng"], w["rng"])
        for part in ("weights", "optim"):
            assert set(g[part]) == set(w[part]) and g[part], part
            for k in w[part]:
                assert g[part][k].dtype == w[part][k].dtype and torch.equal(g[part][k], w[part][k]), (part, k)


def start_ranks(ray, actors, model: str, env_by_rank: list[dict]) -> list:
    """The run's two trainer ranks, each with environment variables of its own (its node's
    local folder): created as RunActors creates them, set up on rank 0's address."""
    from ratchet.workers.actors import Role
    from ratchet.workers.actors.names import NAMESPACE
    from ratchet.workers.actors.placement import actor_env
    from ratchet.workers.trainer import TrainerWorker

    cls = ray.remote(concurrency_groups=TrainerWorker.CONCURRENCY_GROUPS)(TrainerWorker)
    ranks = []
    for rank, extra in enumerate(env_by_rank):
        env = actor_env(actors.cfg, actors.cfg.resources.trainer_cpus) or {"env_vars": {}}
        env["env_vars"] = {**env["env_vars"], **extra}
        ranks.append(
            cls.options(
                name=actors.name(Role.TRAINER, rank),
                namespace=NAMESPACE,
                lifetime="detached",
                max_concurrency=1,
                num_cpus=actors.cfg.resources.trainer_cpus,
                runtime_env=env,
            ).remote(actors.cfg, model, actors.run_uri, rank, 2)  # fmt: skip
        )
    host, port = ray.get(ranks[0].rendezvous_address.remote())
    ray.get([a.setup.remote(port, host) for a in ranks])
    return ranks


def checkpoint(ray, ranks: list, step: int, *, redo: bool = False) -> list:
    """What the `checkpoint` activity does: every rank starts it, then every rank's outcome."""
    if not redo:
        ray.get([a.start_checkpoint.remote(step, {"next_step": step}) for a in ranks])
        return [o.error for o in ray.get([a.wait_checkpoint.remote() for a in ranks])]
    return [o.error for o in ray.get([a.redo_checkpoint.remote() for a in ranks])]


def test_two_ranks_without_a_shared_disk_checkpoint_and_restore_from_the_store(platform, ray_driver, tmp_path, caplog):
    """Each rank stages its shard under its own node's folder and uploads it; the manifest
    (committed only once both uploads are done) lists both shards. A broken disk on one
    node, or a shard missing from the store, commits nothing and is reported; the redo
    commits. Then both nodes'
    folders are deleted and the ranks killed: recovery builds fresh ranks that fetch from
    the object store, skip a checkpoint whose rank-1 shard is corrupted, and end with the
    weights, AdamW state and RNG bit-identical to the lost ranks'."""
    from ratchet.config import load_config
    from ratchet.platform.client import RECIPE_PATH
    from ratchet.workers.actors import RunActors, release_run_actors
    from ratchet.workers.actors.recovery import restore_trainers
    from ratchet.workers.local_paths import ENV_VAR

    run_id = "two-nodes-ckpt"
    cfg = load_config(RECIPE_PATH, platform.overrides(*TINY, *RUN_OVERRIDES))
    actors = RunActors(run_id, str(tmp_path / run_id), cfg)
    run = ObjectStore(actors.run_uri)
    ckpts = CheckpointStore(run)
    stored_step(run)
    nodes = [tmp_path / "node-0", tmp_path / "node-1"]
    model = str(platform.assets.model)
    try:
        ranks = start_ranks(ray_driver, actors, model, [{ENV_VAR: str(n)} for n in nodes])
        ray_driver.get([a.train.remote(0, 0, 0.0) for a in ranks])

        # Node 1's disk fails (a file where rank 1 stages): both ranks report it, naming
        # rank 1, and nothing is committed (no rank waits for ever in a collective).
        broken = nodes[1] / "staging" / run_id / "step-00000001"
        broken.parent.mkdir(parents=True)
        broken.write_text("in the way")
        errors = checkpoint(ray_driver, ranks, 1)
        assert errors[0] == errors[1] and "failed on trainer rank 1: NotADirectoryError" in errors[0], errors
        assert ckpts.list() == []
        broken.unlink()
        # Rank 1's shard does not land in the store (a folder in its way, which the local
        # store puts the file into): rank 0 refuses to commit a manifest naming it.
        blocker = tmp_path / run_id / RunLayout.CHECKPOINTS / "step-00000001" / SHARDS[1]
        blocker.mkdir(parents=True)
        errors = checkpoint(ray_driver, ranks, 1, redo=True)
        assert errors[0].startswith("checkpoint step-00000001 failed on trainer rank 0: FileNotFoundError") and SHARDS[1] in errors[0]
        assert ckpts.list() == []
        shutil.rmtree(blocker)
        assert checkpoint(ray_driver, ranks, 1, redo=True) == [None, None]
        # Taken again once committed (a retried activity): both ranks upload into the attempt
        # folder rank 0 named, and the new manifest replaces the old one (the restore below
        # falls back to this one and reads it from there).
        assert checkpoint(ray_driver, ranks, 1, redo=True) == [None, None]
        assert ckpts.get("step-00000001").attempt == "attempt-1"
        # Each rank staged under its own node's folder, and cleaned it up.
        for node in nodes:
            assert (node / "staging" / run_id).is_dir() and not any((node / "staging" / run_id).iterdir())

        ray_driver.get([a.train.remote(0, 1, 0.0) for a in ranks])  # v1 -> v2, logged: replayed later
        assert checkpoint(ray_driver, ranks, 2) == [None, None]
        before = ray_driver.get([a.__ray_call__.remote(_full_state) for a in ranks])
        assert before[0]["version"] == 2

        # The layout is the one every earlier checkpoint has: both shards and the meta file
        # under trainer/, each with its size and sha256 in the manifest.
        for name in ("step-00000001", "step-00000002"):
            info = ckpts.get(name)
            trainer_files = sorted(r for r in info.files if r.startswith("trainer/"))
            assert trainer_files == [*SHARDS, "trainer/trainer_meta.json"]
            assert RunLayout.RUN_STATE in info.files and any(r.startswith("hf/") for r in info.files)
            assert all(f["size"] > 0 and len(f["sha256"]) == 64 for f in info.files.values())
            assert ckpts.verify(name)
            assert info.meta == {"step": int(name[-1]), "policy_version": int(name[-1]), "world_size": 2}

        # Rank 1's shard of the newest checkpoint rots in storage (same size, other bytes).
        rotten = tmp_path / run_id / RunLayout.CHECKPOINTS / "step-00000002" / SHARDS[1]
        data = bytearray(rotten.read_bytes())
        data[-1] ^= 0xFF
        rotten.write_bytes(bytes(data))

        # Both nodes die: their folders and the ranks are gone.
        for node in nodes:
            shutil.rmtree(node)
        actors.trainer.kill()

        with caplog.at_level(logging.WARNING, logger="ratchet.storage.checkpoint_store"):
            ranks = restore_trainers(actors, actors.trainer, 2)
        assert "checkpoint" in caplog.text and "step-00000002 is corrupted" in caplog.text
        after = ray_driver.get([a.__ray_call__.remote(_full_state) for a in ranks])
        assert_same(after, before)
        assert not any(n.exists() for n in nodes), "the restore needed nothing of the dead nodes' folders"
        assert ray_driver.get([a.__ray_call__.remote(_restore_folders, run_id) for a in ranks]) == [[], []]
    finally:
        release_run_actors(run_id)
