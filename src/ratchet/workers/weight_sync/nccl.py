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
from typing import Iterator

import torch
import torch.distributed as dist

from .buckets import Manifest, gather_tensors
from .cuda_ipc import FlatLayout, flat_layout, flatten_bucket, unflatten_bucket


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


def broadcast_buckets(group, entries: list, manifest: Manifest, device: str | torch.device) -> int:
    """Every trainer rank (the gathers are collectives); rank 0, the one holding `group`
    (None on the others), broadcasts each bucket flat on `device` to the engine group in
    manifest order, without a round trip through host memory. Returns the bytes sent.
    One flat bucket is alive at a time."""
    sent = 0
    for specs, tensors in gather_tensors(entries, manifest):
        if group is not None:
            layout = flat_layout(specs)
            flat = flatten_bucket(tensors, layout, device)
            group.broadcast([flat], _from_rank0()).wait()
            sent += layout.nbytes
            del flat
        del tensors
    return sent


def receive_buckets(group, manifest: Manifest, device: str | torch.device) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """An engine worker: each bucket's (name, tensor) views as it arrives, in manifest
    order; the buffer is reused for the next bucket once the caller moved on."""
    for layout in bucket_layouts(manifest):
        flat = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
        group.broadcast([flat], _from_rank0()).wait()
        yield unflatten_bucket(flat, layout)
        del flat
