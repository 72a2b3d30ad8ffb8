"""How fast do checkpoints move? Upload (`CheckpointStore.commit`) and download
(`CheckpointStore.download`, sha256-verified) throughput of a folder of safetensors-like
files (random bytes, a few files), to:

1. a local folder;
2. an S3-protocol server through `s3://` (s3fs) and through `minio://` (the minio client);
3. next to the raw `minio` client (`fput_object` / `fget_object`, its defaults) on the
   same server and files: the reference ratchet's upload should reach >= 80% of.

The server is moto in server mode, in its own process (so it does not share this
process's GIL) and keeping objects in RAM; each checkpoint is deleted after it is measured.
The ratchet numbers include what a checkpoint needs beyond raw transfer: sha256 of every
byte (both ways), the manifest, and the atomic rename of downloads. Prints one table.

    .venv/bin/python benchmarks/checkpoint.py [--sizes-mb 100 1000] [--files 4]
    .venv/bin/python benchmarks/checkpoint.py --smoke   # seconds: that it still runs (make test does)
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ratchet.storage.checkpoint_store import CheckpointStore
from ratchet.storage.object_store import ObjectStore

log = logging.getLogger("benchmarks.checkpoint")

MiB = 1 << 20
ACCESS_KEY, SECRET_KEY, REGION = "bench-access-key", "bench-secret-key-not-a-real-one", "us-east-1"


@dataclass
class Row:
    size_mb: int
    target: str
    up_mb_s: float
    down_mb_s: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(port: int) -> subprocess.Popen:
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return server
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError(f"moto_server did not listen on 127.0.0.1:{port} within 30 s")


def make_checkpoint(root: Path, total_mb: int, files: int) -> Path:
    """`files` shards of random bytes adding up to `total_mb` MiB, plus a small config."""
    root.mkdir(parents=True)
    per = total_mb * MiB // files
    for i in range(files):
        with open(root / f"model-{i + 1:05d}-of-{files:05d}.safetensors", "wb") as f:
            for _ in range(per // (16 * MiB)):
                f.write(os.urandom(16 * MiB))
            f.write(os.urandom(per % (16 * MiB)))
    (root / "config.json").write_text('{"hidden_size": 4096}')
    return root


def dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def measure_ratchet(url: str, local: Path, work: Path) -> tuple[float, float]:
    """(upload MB/s, download MB/s) of one checkpoint through CheckpointStore."""
    ckpts = CheckpointStore(ObjectStore(url))
    ckpts.list()  # connect first (the raw client is connected too): measure transfer, not set-up
    mb = dir_bytes(local) / MiB
    name = f"step-{uuid.uuid4().hex[:8]}"
    t0 = time.perf_counter()
    ckpts.commit(name, local, {"step": 1})
    up = time.perf_counter() - t0
    out = work / f"dl-{name}"
    t0 = time.perf_counter()
    ckpts.download(name, out, verify=True)
    down = time.perf_counter() - t0
    ckpts.delete(name)
    shutil.rmtree(out)
    return mb / up, mb / down


def measure_raw_minio(client, bucket: str, local: Path, work: Path) -> tuple[float, float]:
    """(upload MB/s, download MB/s) of the same files with the bare minio client."""
    files = sorted(p for p in local.rglob("*") if p.is_file())
    mb = dir_bytes(local) / MiB
    t0 = time.perf_counter()
    for p in files:
        client.fput_object(bucket, f"raw/{p.name}", str(p))
    up = time.perf_counter() - t0
    out = work / "dl-raw"
    t0 = time.perf_counter()
    for p in files:
        client.fget_object(bucket, f"raw/{p.name}", str(out / p.name))
    down = time.perf_counter() - t0
    for p in files:
        client.remove_object(bucket, f"raw/{p.name}")
    shutil.rmtree(out)
    return mb / up, mb / down


# --------------------------------------------------------------------------- training stall


def _trainer_of_size(size_mb: int):
    """A stand-in trainer whose state (fp32 weights + two AdamW moments) is ~size_mb: what
    `ratchet.workers.checkpointing` reads (model, optimizer, version, rank, world size)."""
    from types import SimpleNamespace

    import torch

    layers = max(1, round(size_mb * 2**20 / 12 / (1024 * 1024)))
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()  # AdamW moments exist, as after any real update
    return SimpleNamespace(model=model, optimizer=opt, version=1, rank=0, world_size=1)


def training_stall_rows(targets: dict[str, str], checkpoints: dict[int, Path]) -> list[tuple[str, ...]]:
    """Per size and target: how long training is blocked per checkpoint (the in-memory
    snapshot; the write, export and upload run in a background thread, as the trainer
    worker does), against a synchronous save (write the state, then upload it)."""
    import torch

    from ratchet.storage.checkpoint_store import CheckpointStore
    from ratchet.storage.object_store import ObjectStore
    from ratchet.workers.checkpointing import save_trainer_state, snapshot, write_snapshot

    torch.set_num_threads(1)
    rows = []
    for size in checkpoints:
        trainer = _trainer_of_size(size)
        for label, url in targets.items():
            store = CheckpointStore(ObjectStore(url).child("stall"))
            with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
                t0 = time.perf_counter()
                save_trainer_state(trainer, Path(tmp) / "sync")
                store.commit(f"sync-{size}", Path(tmp) / "sync", {"step": 1})
                synchronous = time.perf_counter() - t0
                t0 = time.perf_counter()
                snap = snapshot(trainer)
                stall = time.perf_counter() - t0
                write_snapshot(snap, Path(tmp) / "async")  # the background part, timed apart
                store.commit(f"async-{size}", Path(tmp) / "async", {"step": 2})
            rows.append((f"{size} MiB", label, f"{stall:.3f} s", f"{synchronous:.2f} s", f"{stall / synchronous:.1%}"))
    return rows


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 1000], help="checkpoint sizes in MiB")
    ap.add_argument("--files", type=int, default=4, help="shard files per checkpoint")
    ap.add_argument(
        "--smoke", action="store_true", help="seconds, to show the script still runs (make test does): one 2 MiB checkpoint of 2 files"
    )
    args = ap.parse_args()
    if args.smoke:
        args.sizes_mb, args.files = [2], 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("ratchet.storage").setLevel(logging.WARNING)

    port = free_port()
    server = start_moto(port)
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID=ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION=REGION,
    )  # fmt: skip
    from minio import Minio

    client = Minio(f"127.0.0.1:{port}", access_key=ACCESS_KEY, secret_key=SECRET_KEY, secure=False, region=REGION)
    bucket = "ratchet-bench"
    client.make_bucket(bucket)
    work = Path(tempfile.mkdtemp(dir="/tmp", prefix="rt-ckpt-bench-"))
    targets = {
        "local folder": str(work / "store"),
        "s3:// (s3fs)": f"s3://{bucket}/s3",
        "minio:// (minio client)": f"minio://{bucket}/minio",
    }
    rows: list[Row] = []
    raw: dict[int, float] = {}
    checkpoints: dict[int, Path] = {}
    try:
        for size in args.sizes_mb:
            local = make_checkpoint(work / f"ckpt-{size}", size, args.files)
            checkpoints[size] = local
            log.info("%d MiB: raw minio client", size)
            up, down = measure_raw_minio(client, bucket, local, work)
            raw[size] = up
            rows.append(Row(size, "raw minio fput/fget_object", up, down))
            for label, url in targets.items():
                log.info("%d MiB: %s", size, label)
                up, down = measure_ratchet(url, local, work)
                rows.append(Row(size, f"ratchet {label}", up, down))
        stall = training_stall_rows(targets, checkpoints)
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(work, ignore_errors=True)

    table = Table(title=f"checkpoint throughput, MB/s (MiB/s; {args.files} shards + config.json; moto server on 127.0.0.1)")
    for col, justify in (
        ("size", "right"),
        ("target", "left"),
        ("upload", "right"),
        ("download", "right"),
        ("upload / raw minio", "right"),
    ):
        table.add_column(col, justify=justify)
    for r in rows:
        remote = "local" not in r.target and "raw" not in r.target
        ratio = f"{r.up_mb_s / raw[r.size_mb]:.0%}" if remote else ""
        table.add_row(f"{r.size_mb} MiB", r.target, f"{r.up_mb_s:.0f}", f"{r.down_mb_s:.0f}", ratio)
    console = Console(width=160)
    console.print(table)
    console.print("ratchet numbers include sha256 of every byte both ways, the manifest, and verified downloads.")
    if stall:
        t2 = Table(title="training stall per checkpoint vs synchronous save")
        for col in ("size", "target", "stall per checkpoint", "synchronous save", "stall / synchronous"):
            t2.add_column(col)
        for row in stall:
            t2.add_row(*row)
        console.print(t2)


if __name__ == "__main__":
    main()
