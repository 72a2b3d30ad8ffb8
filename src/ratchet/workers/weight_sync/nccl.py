"""Weight sync by broadcast from trainer rank 0 into a separate process group with the
engines (split placement on GPUs): each bucket is packed into one flat tensor and
broadcast once; every engine worker (each tensor-parallel rank of each replica) receives
it into a buffer sized from the manifest, and loads the views through its engine's own
`load_weights` (vLLM and SGLang then shard per tensor-parallel rank themselves).

The group is made from its own TCPStore, apart from the trainer's FSDP group, so
the trainer's ranks and the engines need not share one world (what verl and OpenRLHF do
with a "stateless" group). The backend is NCCL on GPUs; the CPU tests run the very same
code with gloo standing in (tests/unit/test_weight_sync.py says so).
"""

from __future__ import annotations

from datetime import timedelta
import torch
import torch.distributed as dist

from .buckets import Manifest
from .cuda_ipc import FlatLayout, flat_layout, unflatten_bucket


def init_engine_group(host: str, port: int, rank: int, world_size: int, *, backend: str = "nccl", timeout_s: float = 300.0):
    """A process group of `world_size` members (rank 0: the trainer's rank 0; the rest: the
    engine workers), independent of any default group. Every member calls it."""
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))
    raise ValueError(f"engine group backend must be nccl or gloo, got {backend!r}")


def _from_rank0():
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts


def bucket_layouts(manifest: Manifest) -> list[FlatLayout]:
    return [flat_layout(tuple(manifest.specs[i] for i in members)) for members in manifest.buckets]


def receive_bucket(group, layout: FlatLayout, device: str | torch.device) -> list[tuple[str, torch.Tensor]]:
    """An engine worker's receipt of one bucket, broadcast flat by trainer rank 0
    (device_sync.gather_and_broadcast): (name, tensor) views into a buffer of its own."""
    flat = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    group.broadcast([flat], _from_rank0()).wait()
    return unflatten_bucket(flat, layout)
