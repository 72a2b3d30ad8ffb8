"""How fast is a trainer -> engine weight sync through Ray's object store on one node, and
how much extra memory does it take?

Two synthetic Llama models (~100 MB and ~1 GB of float32 weights, random, built here)
sit in a trainer actor that runs ratchet's own object-store sync (`TrainerWorker.send_weights`
and the `sync_*` relay methods, driven by `weight_sync.transport.relayed_sync`) into a receiver
actor that loads every bucket into a model of its own through the HF engine's
`load_weights`. For each bucket size: GB/s (model bytes / sync seconds, as the driver
sees it, best of --repeats after a warm-up sync), and the peak extra memory during the
sync: the private resident memory (RSS minus shared pages) high-water of the trainer and
of the receiver process above their level before it (psutil, sampled every 2 ms), and
the object store's bytes in use (the buckets in flight, shared by both). Bucketed means
the extra is a few buckets, not a model copy. Prints one table.

    .venv/bin/python benchmarks/weight_sync.py [--sizes 100,1000] [--buckets 16,64,256] [--repeats 2]
    .venv/bin/python benchmarks/weight_sync.py --smoke   # seconds: that it still runs (make test does)
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from types import SimpleNamespace

os.environ.setdefault("OMP_NUM_THREADS", "1")

import ray  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from ratchet.config.schema import RunConfig  # noqa: E402
from ratchet.workers.trainer import TrainerWorker  # noqa: E402
from ratchet.workers.weight_sync import MB, as_source  # noqa: E402
from ratchet.workers.weight_sync.ray_transport import OBJECT_STORE  # noqa: E402
from ratchet.workers.weight_sync.transport import relayed_sync  # noqa: E402


def llama_config(megabytes: float):
    """A Llama config with about `megabytes` of float32 weights."""
    from transformers import LlamaConfig

    hidden, inter, vocab = (512, 1536, 16000) if megabytes < 400 else (1024, 4096, 32000)
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    fixed = 2 * vocab * hidden + hidden
    layers = max(1, round((megabytes * MB / 4 - fixed) / per_layer))
    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64, tie_word_embeddings=False, max_position_embeddings=256,
    )  # fmt: skip


def build_model(config, seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # cheap distinct values (init kernels are slow on one core)
            p.copy_(torch.rand(p.shape) if seed else torch.zeros(p.shape))
    return model


class PeakRss:
    """High-water of this process's private resident memory (RSS minus shared pages: the
    object store's pages are shared and counted apart) above its level at `start`,
    sampled in a thread."""

    def __init__(self):
        import psutil

        self.proc, self.peak, self.base, self._stop = psutil.Process(), 0, 0, threading.Event()

    def start(self) -> None:
        self.base = self.peak = self._private()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._private())
            time.sleep(0.002)

    def _private(self) -> int:
        m = self.proc.memory_info()
        return m.rss - m.shared

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak - self.base


class BenchTrainer(TrainerWorker):
    """ratchet's trainer worker around a synthetic model (no files, one rank)."""

    def __init__(self, config, bucket_mb: float):
        self.cfg = RunConfig.model_validate(
            {"model": {"path": "synthetic"}, "data": {"train_files": "x.parquet"}, "storage": {"root": "/tmp"},
             "trainer": {"sync_bucket_mb": bucket_mb}}
        )  # fmt: skip
        self.rank, self.world_size = 0, 1
        self.trainer = SimpleNamespace(model=build_model(config, seed=1), version=1)
        from ratchet.workers.weight_sync.sender import WeightSender

        self.weights = WeightSender(self.cfg, 0, 1, lambda: self.trainer)
        self.rss = PeakRss()

    def set_bucket_mb(self, bucket_mb: float) -> None:
        self.cfg.trainer.sync_bucket_mb = bucket_mb

    def rss_start(self) -> None:
        self.rss.start()

    def rss_stop(self) -> int:
        return self.rss.stop()

    def checksum(self) -> float:
        return float(sum(p.double().sum() for p in self.trainer.model.parameters()))


class BenchEngine:
    """A receiver that loads like the rollout worker: a weight source, bucket by bucket,
    into a model through the HF engine's `load_weights`."""

    def __init__(self, config):
        self.model = build_model(config, seed=0)
        self.rss = PeakRss()

    def load_weights(self, weights, version=None) -> int:
        from ratchet.workers.engines.hf import HFEngine

        source = as_source(weights, version)
        source.manifest()
        HFEngine.load_weights(self, source.pairs())
        return source.nbytes

    def receive_weights(self, transport: str, rank, sync_id: str, consumer: int) -> int:
        return self.load_weights(OBJECT_STORE.source(self, rank, sync_id, consumer))

    def rss_start(self) -> None:
        self.rss.start()

    def rss_stop(self) -> int:
        return self.rss.stop()

    def checksum(self) -> float:
        return float(sum(p.double().sum() for p in self.model.parameters()))


class PlasmaPeak:
    """High-water of the object store's bytes in use, sampled from the raylet (an RPC per
    sample, tens of ms: a lower bound on short peaks; the relay's own count of buckets
    held is the exact figure)."""

    def __init__(self):
        from ray._private.internal_api import get_memory_info_reply, get_state_from_address

        self._state = get_state_from_address(ray.get_runtime_context().gcs_address)
        self._reply = get_memory_info_reply
        self.peak, self._stop = 0, threading.Event()

    def used(self) -> int:
        return self._reply(self._state).store_stats.object_store_bytes_used

    def __enter__(self):
        self.base = self.used()
        self.peak = self.base
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.used())
            time.sleep(0.005)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run(size_mb: float, bucket_sizes: list[float], repeats: int) -> list[dict]:
    config = llama_config(size_mb)
    trainer = (
        ray.remote(concurrency_groups=BenchTrainer.CONCURRENCY_GROUPS)(BenchTrainer).options(num_cpus=1).remote(config, bucket_sizes[0])
    )
    engine = ray.remote(BenchEngine).options(num_cpus=1).remote(config)
    rows = []
    try:
        expected = ray.get(trainer.checksum.remote())
        for bucket_mb in bucket_sizes:
            ray.get(trainer.set_bucket_mb.remote(bucket_mb))
            relayed_sync(OBJECT_STORE, [trainer], [engine], ray.get)  # warm-up: first touches of the store's pages
            best = None
            for _ in range(repeats):
                ray.get([trainer.rss_start.remote(), engine.rss_start.remote()])
                with PlasmaPeak() as plasma:
                    t0 = time.perf_counter()
                    result = relayed_sync(OBJECT_STORE, [trainer], [engine], ray.get)
                    seconds = time.perf_counter() - t0
                rss_trainer, rss_engine = ray.get([trainer.rss_stop.remote(), engine.rss_stop.remote()])
                row = dict(
                    model_mb=result.bytes / MB, bucket_mb=bucket_mb, buckets=result.buckets, seconds=seconds,
                    gbps=result.bytes / seconds / 1e9, rss_trainer=rss_trainer / MB, rss_engine=rss_engine / MB,
                    plasma=max(0, plasma.peak - plasma.base) / MB, window=result.window_peak,
                )  # fmt: skip
                best = row if best is None or row["seconds"] < best["seconds"] else best
            got = ray.get(engine.checksum.remote())
            if abs(got - expected) > 1e-6 * abs(expected):
                raise RuntimeError(f"the engine's weights differ from the trainer's after the sync ({got} != {expected})")
            rows.append(best)
    finally:
        ray.kill(trainer)
        ray.kill(engine)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="100,1000", help="model sizes in MB of float32 weights")
    parser.add_argument("--buckets", default="16,64,256", help="bucket bounds in MB (trainer.sync_bucket_mb)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--smoke", action="store_true", help="seconds, to show the script still runs (make test does): a 4 MB model in 1 MB buckets, once"
    )
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.buckets, args.repeats = "4", "1", 1
    sizes = [float(x) for x in args.sizes.split(",")]
    buckets = [float(x) for x in args.buckets.split(",")]
    ray.init(num_cpus=4, object_store_memory=int(3 * 1024 * MB), include_dashboard=False, log_to_driver=False)
    try:
        rows = [r for size in sizes for r in run(size, buckets, args.repeats)]
    finally:
        ray.shutdown()
    table = Table(title="weight sync trainer -> engine through Ray's object store, one node (best of %d)" % args.repeats)
    for col in (
        "model MB",
        "bucket MB",
        "buckets",
        "seconds",
        "GB/s",
        "peak extra private RSS trainer MB",
        "peak extra private RSS engine MB",
        "peak object store MB (sampled)",
        "most buckets held by rank 0",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{r['model_mb']:.0f}", f"{r['bucket_mb']:g}", str(r["buckets"]), f"{r['seconds']:.3f}", f"{r['gbps']:.2f}",
            f"{r['rss_trainer']:.0f}", f"{r['rss_engine']:.0f}", f"{r['plasma']:.0f}", str(r["window"]),
        )  # fmt: skip
    Console(width=180).print(table)


if __name__ == "__main__":
    main()
