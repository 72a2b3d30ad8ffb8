"""Which transport a weight sync takes (config/sync_transport.py), the submit-time refusal
of a forced one the placement cannot carry, and the two device transports wired end to
end through the actors' own methods (weight_sync/device_sync.py).

The wiring tests run without Ray: real `TrainerWorker` and `RolloutWorker` objects (tiny
model, HF engine) behind `Direct`, an in-process stand-in for an actor handle
(`h.method.remote(...)` runs the real method on a thread and returns a Future). Their CUDA
parts are stood in on CPU by what torch provides: CPU shared memory for the CUDA IPC
handles (reduce_tensor picks the transport by device) and gloo for NCCL (the engine
group's backend follows the device). The `gpu`-marked tests at the end run the real
CUDA IPC and NCCL paths."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ratchet.config.placement_plan import plan_placement
from ratchet.config.loader import ConfigError, parse_config
from ratchet.config.schema import RunConfig
from ratchet.config.sync_transport import Transport, choose_transport, ipc_partners

torch.set_num_threads(1)

BUCKET_MB = 0.1  # the tiny model (~4 MB) in a few dozen buckets


def config(
    pools=None, *, world=1, replicas=1, mode="sync", transport="auto", device="auto", root="/tmp/r", model="m", data="d.parquet",
    rollout=None,
) -> RunConfig:  # fmt: skip
    """The config, through the submit check of the config alone (its cross-section checks included)."""
    return parse_config(
        {
            "seed": 0,
            "model": {"path": str(model)},
            "data": {"train_files": str(data)},
            "rollout": {"n": 2, "max_response_length": 8, "replicas": replicas, **(rollout or {})},
            "loop": {"steps": 2, "mode": mode},
            "trainer": {"world_size": world, "sync_transport": transport, "device": device, "sync_bucket_mb": BUCKET_MB},
            "storage": {"root": str(root)},
            "resources": {"pools": pools or []},
        }
    )  # fmt: skip


def pool(name, roles, *, gpus=0, nodes=1, cpus=8):
    return {"name": name, "nodes": nodes, "cpus_per_node": cpus, "gpus_per_node": gpus, "roles": roles}


ALL = ["trainer", "rollout", "reward"]


def chosen(cfg: RunConfig) -> Transport:
    return choose_transport(plan_placement(cfg), cfg)


# --------------------------------------------------------------------------- the decision table


@pytest.mark.parametrize(
    "pools, kw, expected",
    [
        (None, {}, Transport.OBJECT_STORE),  # no pools: Ray may put the actors anywhere, on CPUs
        ([pool("all", ALL)], {}, Transport.OBJECT_STORE),  # colocated on CPU
        ([pool("t", ["trainer"]), pool("g", ["rollout", "reward"])], {}, Transport.OBJECT_STORE),  # split on CPU
        ([pool("all", ALL, gpus=2)], {"world": 2, "replicas": 2}, Transport.CUDA_IPC),  # colocated on GPUs
        ([pool("all", ALL, gpus=2)], {"world": 1, "replicas": 2}, Transport.OBJECT_STORE),  # replica 1's GPU has no trainer rank
        ([pool("all", ALL, gpus=2)], {"device": "cpu"}, Transport.OBJECT_STORE),  # the trainer told to stay on CPU
        ([pool("t", ["trainer"], gpus=2), pool("g", ["rollout", "reward"], gpus=2)], {"mode": "fully_async"}, Transport.NCCL),
        ([pool("t", ["trainer"], gpus=2), pool("g", ["rollout", "reward"], gpus=1, nodes=2)], {}, Transport.OBJECT_STORE),  # nodes
        ([pool("t", ["trainer"], gpus=1), pool("g", ["rollout", "reward"])], {}, Transport.OBJECT_STORE),  # engines on CPU
        ([pool("t", ["trainer"], gpus=2), pool("g", ["rollout", "reward"], gpus=1, nodes=2)], {"transport": "nccl"}, Transport.NCCL),
        ([pool("all", ALL, gpus=2)], {"world": 2, "replicas": 2, "transport": "object_store"}, Transport.OBJECT_STORE),
        ([pool("all", ALL)], {"transport": "object_store"}, Transport.OBJECT_STORE),
    ],
)  # fmt: skip
def test_the_transport_follows_the_placement(pools, kw, expected):
    assert chosen(config(pools, **kw)) is expected


def test_ipc_partners_are_the_trainer_ranks_on_each_replicas_gpu():
    cfg = config([pool("all", ALL, gpus=4)], world=4, replicas=4)
    assert ipc_partners(plan_placement(cfg), cfg) == [0, 1, 2, 3]
    tp2 = config([pool("all", ALL, gpus=4)], world=4, replicas=2, rollout={"engine": "vllm", "vllm": {"tensor_parallel_size": 2}})
    assert ipc_partners(plan_placement(tp2), tp2) == [0, 2]  # replica k on GPU 2k, with trainer rank 2k


@pytest.mark.parametrize(
    "pools, kw, says",
    [
        (None, {"transport": "cuda_ipc"}, "without pools the actors hold no GPUs"),
        ([pool("all", ALL)], {"transport": "cuda_ipc"}, "the trainer runs on CPU"),
        ([pool("t", ["trainer"]), pool("g", ["rollout", "reward"])], {"transport": "nccl"}, "on CPU"),
        ([pool("all", ALL, gpus=2)], {"transport": "nccl", "device": "cpu"}, "trainer.device is cpu"),
        ([pool("t", ["trainer"], gpus=1), pool("g", ["rollout", "reward"])], {"transport": "nccl"}, "the rollout replicas run on CPU"),
        ([pool("t", ["trainer"], gpus=1), pool("g", ["rollout", "reward"], gpus=1)], {"transport": "cuda_ipc"}, "separate pools"),
        ([pool("all", ALL, gpus=2)], {"transport": "cuda_ipc", "replicas": 2}, "no trainer rank on its GPU"),
        ([pool("all", ALL, gpus=1)], {"transport": "nccl"}, "NCCL cannot join two processes on one GPU"),
    ],
)  # fmt: skip
def test_a_forced_transport_the_placement_cannot_carry_is_refused_at_submit(pools, kw, says):
    with pytest.raises(ConfigError) as info:
        config(pools, **kw)
    text = str(info.value)
    assert "trainer.sync_transport is" in text and says in text and ("auto" in text or "object_store" in text)


# --------------------------------------------------------------------------- the wiring, in-process


class Direct:
    """An in-process stand-in for a Ray actor handle: `h.method.remote(*args)` runs the real
    method of the wrapped worker on a thread of its own and returns a Future."""

    def __init__(self, obj, pool: ThreadPoolExecutor):
        self.obj, self._pool = obj, pool

    def __getattr__(self, name: str):
        method = getattr(self.obj, name)
        return SimpleNamespace(remote=lambda *args: self._pool.submit(method, *args))


def wait(futures):
    return [f.result(timeout=120) for f in futures]


@pytest.fixture(scope="module")
def copy_data(tmp_path_factory) -> Path:
    from ratchet.tasks.generate import write_task_parquet

    return write_task_parquet(tmp_path_factory.mktemp("data") / "copy.parquet", "copy", 8, seed=0, min_len=4, max_len=4)


@pytest.fixture(scope="module")
def threads():
    with ThreadPoolExecutor(max_workers=32, thread_name_prefix="actor-call") as pool:
        yield pool


@pytest.fixture(scope="module")
def run(tiny_model, copy_data, tmp_path_factory):
    """A trainer rank (world 1, CPU) and a factory of rollout replicas, of one run."""
    from ratchet.workers.rollout import RolloutWorker
    from ratchet.workers.trainer import TrainerWorker

    root = tmp_path_factory.mktemp("run")
    cfg = config(root=root, model=tiny_model, data=copy_data)
    trainer = TrainerWorker(cfg, str(tiny_model), str(root), 0, 1)
    trainer.setup(0)
    return SimpleNamespace(cfg=cfg, trainer=trainer, replica=lambda: RolloutWorker(cfg, str(tiny_model), str(root)))


def new_policy(trainer, seed: int) -> dict[str, torch.Tensor]:
    """Give the trainer other weights (as an update would) and return them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.trainer.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p  # FSDP2 on CUDA, even on one rank
            local.add_(0.05 * torch.randn(local.shape, generator=g).to(local.device))
    trainer.trainer.version += 1
    state = trainer.trainer.model.state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def assert_serves(replica, weights: dict[str, torch.Tensor], version: int) -> None:
    state = replica.engine.model.state_dict()
    assert replica.version == version
    assert all(torch.equal(state[k], v) for k, v in weights.items()), "the engine does not hold the trainer's weights bit-exact"


def test_cuda_ipc_sync_through_the_actors_with_shared_memory_standing_in(run, threads):
    """CUDA IPC wiring (trainer.send_weights, sync_take, replica.receive_weights)
    with CPU shared memory standing in for the CUDA IPC handles: one trainer rank hands
    every bucket by handle to two replicas, which load it and acknowledge; the rank holds
    at most two buckets, and both engines end bit-exact on the trainer's weights."""
    from ratchet.workers.weight_sync.device_sync import CUDA_IPC
    from ratchet.workers.weight_sync.transport import relayed_sync

    replicas = [run.replica(), run.replica()]
    weights = new_policy(run.trainer, seed=1)
    _, manifest = run.trainer.weights.plan()
    result = relayed_sync(CUDA_IPC, [Direct(run.trainer, threads)], [Direct(r, threads) for r in replicas], wait, serving=[0, 0])
    assert result.transport == "cuda_ipc" and result.replicas == 2 and result.version == run.trainer.trainer.version
    assert result.buckets == len(manifest.buckets) > 5
    assert result.bytes == 2 * manifest.total_bytes
    assert 1 <= result.window_peak <= 2  # the rank's shared buckets never exceed the window
    for r in replicas:
        assert_serves(r, weights, result.version)


def test_an_ipc_sync_of_non_finite_weights_reaches_no_engine(run, threads):
    """As above (shared memory for CUDA IPC): NaN weights are refused before any handle
    leaves; the trainer's error is the one raised, and the replica keeps its version."""
    from ratchet.errors import NonFiniteError
    from ratchet.workers.weight_sync.device_sync import CUDA_IPC
    from ratchet.workers.weight_sync.transport import relayed_sync

    replica = run.replica()
    param = next(run.trainer.trainer.model.parameters())
    keep = param.detach().clone()
    with torch.no_grad():
        param[0, 0] = float("nan")
    try:
        with pytest.raises(NonFiniteError, match="NaN"):
            relayed_sync(CUDA_IPC, [Direct(run.trainer, threads)], [Direct(replica, threads)], wait)
    finally:
        with torch.no_grad():
            param.copy_(keep)
    assert replica.version == 0


def test_nccl_sync_through_the_actors_with_gloo_standing_in(run, threads):
    """NCCL wiring (engine group from a TCPStore on rank 0's side, rank 0 broadcasting each
    bucket once both replicas are ready, manifest and readiness through the actors'
    methods) with gloo standing in for NCCL: both engines bit-exact; the group is made
    once and reused, and made again when a replica is recreated."""
    from ratchet.workers.weight_sync.device_sync import NCCL, ensure_engine_group
    from ratchet.workers.weight_sync.transport import relayed_sync

    rank0 = Direct(run.trainer, threads)
    replicas = [Direct(run.replica(), threads), Direct(run.replica(), threads)]
    weights = new_policy(run.trainer, seed=2)
    result = relayed_sync(NCCL, [rank0], replicas, wait, sync_id=uuid.uuid4().hex)
    assert result.transport == "nccl" and result.replicas == 2 and result.buckets > 5
    _, manifest = run.trainer.weights.plan()
    assert result.bytes == 2 * manifest.total_bytes
    for r in replicas:
        assert_serves(r.obj, weights, result.version)
    first_key = run.trainer.engine_group_key()
    assert first_key and all(r.obj.engine_group_key() == first_key for r in replicas)

    # Same members: the group stays; a sync goes through it again.
    assert ensure_engine_group(rank0, replicas, wait) is False
    weights = new_policy(run.trainer, seed=3)
    assert relayed_sync(NCCL, [rank0], replicas, wait).version == run.trainer.trainer.version
    assert_serves(replicas[1].obj, weights, run.trainer.trainer.version)

    # A replica recreated: the membership changed, the group is made anew for all.
    replicas[1] = Direct(run.replica(), threads)
    weights = new_policy(run.trainer, seed=4)
    result = relayed_sync(NCCL, [rank0], replicas, wait)
    assert run.trainer.engine_group_key() not in (None, first_key)
    for r in replicas:
        assert_serves(r.obj, weights, result.version)


def test_a_replica_that_refuses_a_broadcast_sync_stops_it_without_a_hang(run, threads, monkeypatch):
    """As above (gloo for NCCL): a replica refusing the weights (its model's names differ)
    aborts the sync through Ray before rank 0 broadcasts anything, so the other replica is
    not left waiting inside a collective; both keep their versions."""
    from ratchet.workers.weight_sync import SyncAborted, WeightNamesMismatch
    from ratchet.workers.weight_sync.device_sync import NCCL
    from ratchet.workers.weight_sync.transport import relayed_sync

    good, picky = run.replica(), run.replica()
    # The picky replica serves a model of other names: its names check reads another folder.
    from ratchet.workers import weight_slot

    real = weight_slot.model_weight_names
    picky.slot.policy_path = str(Path(picky.policy_path).parent / "elsewhere")

    def names(path: str):
        return (frozenset({"other.weight"}), frozenset()) if path.endswith("elsewhere") else real(path)

    monkeypatch.setattr(weight_slot, "model_weight_names", names)
    new_policy(run.trainer, seed=5)
    with pytest.raises((WeightNamesMismatch, SyncAborted)) as info:
        relayed_sync(NCCL, [Direct(run.trainer, threads)], [Direct(good, threads), Direct(picky, threads)], wait)
    assert "do not match the rollout model's parameters" in str(info.value)
    assert good.version == 0 and picky.version == 0


# --------------------------------------------------------------------------- on GPUs

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def on_ray_gpus(tmp_path, tiny_model, copy_data, trainer_gpus: float, replica_gpus: float, sync):
    """A trainer rank and a rollout replica as Ray actors (a local Ray of this process) with
    these GPU shares; new weights on the trainer, `sync(ranks, targets)`; returns
    (result, the trainer's weights, the engine's), on the host."""
    import sys

    import ray

    from ratchet.workers.rollout import RolloutWorker
    from ratchet.workers.trainer import TrainerWorker

    if ray.is_initialized():
        pytest.skip("a Ray of this session is connected already; these tests start their own")
    ray.init(num_cpus=2, num_gpus=torch.cuda.device_count(), include_dashboard=False)
    try:
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # new_policy runs in the trainer
        cfg = config(root=tmp_path, model=tiny_model, data=copy_data, device="cuda")
        trainer = ray.remote(num_cpus=0.5, num_gpus=trainer_gpus, concurrency_groups=TrainerWorker.CONCURRENCY_GROUPS)(TrainerWorker)
        rank0 = trainer.remote(cfg, str(tiny_model), str(tmp_path), 0, 1)
        replica = ray.remote(num_cpus=0.5, num_gpus=replica_gpus)(RolloutWorker).remote(cfg, str(tiny_model), str(tmp_path))
        ray.get(rank0.setup.remote(0))
        weights = ray.get(rank0.__ray_call__.remote(lambda w: {k: v.cpu() for k, v in new_policy(w, 1).items()}))
        result = sync([rank0], [replica])
        state = ray.get(replica.__ray_call__.remote(lambda w: {k: v.detach().cpu() for k, v in w.engine.model.state_dict().items()}))
        return result, weights, state
    finally:
        ray.shutdown()


@pytest.mark.gpu
@needs_cuda
def test_cuda_ipc_sync_between_two_ray_actors_on_one_gpu(tiny_model, copy_data, tmp_path):
    """The real CUDA IPC path: trainer rank and replica share one GPU (half each, Ray's
    fractional GPUs), the replica opens the trainer's buckets by handle."""
    from ratchet.workers.weight_sync.device_sync import CUDA_IPC
    from ratchet.workers.weight_sync.transport import relayed_sync

    result, weights, state = on_ray_gpus(tmp_path, tiny_model, copy_data, 0.5, 0.5, lambda r, t: relayed_sync(CUDA_IPC, r, t, ray_get))
    assert result.transport == "cuda_ipc" and result.buckets > 5 and result.window_peak <= 2
    assert all(torch.equal(state[k], v) for k, v in weights.items())


@pytest.mark.gpu
@needs_cuda
def test_nccl_sync_between_two_ray_actors_on_two_gpus(tiny_model, copy_data, tmp_path):
    """The real NCCL path: trainer rank on one GPU, replica on another, one broadcast per bucket."""
    from ratchet.workers.weight_sync.device_sync import NCCL
    from ratchet.workers.weight_sync.transport import relayed_sync

    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL between trainer and engine needs two GPUs")
    result, weights, state = on_ray_gpus(tmp_path, tiny_model, copy_data, 1, 1, lambda r, t: relayed_sync(NCCL, r, t, ray_get))
    assert result.transport == "nccl" and result.buckets > 5
    assert all(torch.equal(state[k], v) for k, v in weights.items())


def ray_get(refs):
    import ray

    return ray.get(refs, timeout=300)
