"""Weight sync by CUDA IPC handles, for a trainer and an engine colocated on one GPU: the
trainer packs a bucket into one flat device tensor and sends only its IPC handle (tens of
bytes); the engine process opens the handle (a view of the trainer's memory, no copy
over PCIe), copies the weights into its own parameters and acknowledges, after which the
trainer frees or reuses the bucket. Peak extra GPU memory: the flat bucket(s) in flight.

`flatten_bucket` / `unflatten_bucket` are pure and run on CPU too (the tests check them
there); `share` / `open_shared` are torch's own tensor reductions
(torch.multiprocessing.reductions.reduce_tensor and the rebuild function it returns),
which carry a CUDA IPC handle for a CUDA tensor. `measure_ipc_bandwidth` times the path
between two processes with torch alone (no Ray): benchmarks/gpu_check.py calls it on a
GPU machine; on CPU the same code moves the buckets through shared memory instead, which
is how the CPU test exercises it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .buckets import TensorSpec

# Each tensor starts at a multiple of this many bytes in a flat bucket (aligned loads).
ALIGN_BYTES = 256


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor of a bucket lies in its flat byte buffer."""

    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]  # byte offsets
    nbytes: int


def flat_layout(specs: tuple[TensorSpec, ...]) -> FlatLayout:
    offsets, pos = [], 0
    for s in specs:
        pos += -pos % ALIGN_BYTES
        offsets.append(pos)
        pos += s.nbytes
    return FlatLayout(specs=specs, offsets=tuple(offsets), nbytes=pos)


def flatten_bucket(tensors: list[torch.Tensor], layout: FlatLayout, device: torch.device | str) -> torch.Tensor:
    """One uint8 tensor on `device` holding `tensors` at the layout's offsets."""
    flat = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    for t, spec, off in zip(tensors, layout.specs, layout.offsets):
        t = t.detach().to(device=device, dtype=getattr(torch, spec.dtype)).contiguous()
        flat[off : off + spec.nbytes].copy_(t.view(-1).view(torch.uint8))
    return flat


def unflatten_bucket(flat: torch.Tensor, layout: FlatLayout) -> list[tuple[str, torch.Tensor]]:
    """(name, view) pairs into `flat`: no copy."""
    out = []
    for spec, off in zip(layout.specs, layout.offsets):
        view = flat[off : off + spec.nbytes].view(getattr(torch, spec.dtype)).view(spec.shape)
        out.append((spec.name, view))
    return out


def share(flat: torch.Tensor):
    """A picklable handle of `flat` (for a CUDA tensor: its CUDA IPC handle). The sender
    keeps `flat` alive until the receiver acknowledged."""
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(flat)


def open_shared(handle, device_index: int | None = None) -> torch.Tensor:
    """The tensor a `share` handle names, in this process. `device_index`: the GPU as this
    process numbers it, when CUDA_VISIBLE_DEVICES differs between the two processes."""
    rebuild, args = handle
    if device_index is not None and len(args) > 6:
        args = list(args)
        args[6] = device_index  # rebuild_cuda_tensor's storage_device
    return rebuild(*args)


@dataclass(frozen=True)
class IpcBandwidth:
    bytes: int
    seconds: float
    buckets: int
    device: str

    @property
    def gb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


def _receiver(queue, acks, total_bytes: int, device: str) -> None:
    """The engine's side: open each handle, copy the bucket into its own buffer, ack."""
    target = torch.empty(total_bytes + 1, dtype=torch.uint8, device=device)  # + the warm-up byte
    pos = 0
    while True:
        item = queue.get()
        if item is None:
            break
        handle, nbytes = item
        flat = open_shared(handle)
        target[pos : pos + nbytes].copy_(flat[:nbytes])
        if target.is_cuda:
            torch.cuda.synchronize()
        del flat
        pos += nbytes
        acks.put(nbytes)
    acks.put(int(target[:pos].sum(dtype=torch.int64).item()) if pos else 0)  # a checksum of what arrived


def measure_ipc_bandwidth(total_mb: float = 1024.0, bucket_mb: float = 256.0, device: str = "cuda") -> IpcBandwidth:
    """Send `total_mb` of random bytes in `bucket_mb` buckets from this process to a
    spawned one through `share`/`open_shared`, one bucket in flight plus one being filled,
    and time it from the first handle to the last acknowledgement. The receiver's checksum
    must match the sent bytes', or ValueError. Needs only torch (and CUDA for device="cuda")."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    total, bucket = int(total_mb * (1 << 20)), int(bucket_mb * (1 << 20))
    sizes = [min(bucket, total - i) for i in range(0, total, bucket)]
    g = torch.Generator(device="cpu").manual_seed(0)
    buckets = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device) for n in sizes[:2]]
    queue, acks = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(queue, acks, total, device), daemon=True)
    proc.start()
    try:
        # Warm the receiver up (process start, CUDA context) before the clock starts.
        queue.put((share(buckets[0][:1]), 1))
        acks.get(timeout=300)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i, n in enumerate(sizes):
            flat = buckets[i % len(buckets)]
            queue.put((share(flat), n))
            acks.get(timeout=300)
        seconds = time.perf_counter() - t0
        queue.put(None)
        checksum = acks.get(timeout=300)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    # The receiver saw bucket 0's first byte in the warm-up, then every bucket (two buffers, reused).
    expected = int(buckets[0][0].item()) + sum(int(buckets[i % len(buckets)][:n].sum(dtype=torch.int64).item()) for i, n in enumerate(sizes))
    if checksum != expected:
        raise ValueError(f"CUDA IPC sync moved wrong bytes: checksum {checksum} != {expected}")
    return IpcBandwidth(bytes=total, seconds=seconds, buckets=len(sizes), device=device)
